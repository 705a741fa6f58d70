"""The ``distune`` command: views of what the tuner is doing and what it found.

``distune status`` asks a running tuning service (REST API v1); ``distune plot`` and
``distune log`` read a CSV tuning log, wherever it was written. These are clients of the API and
the log only: they import neither torch nor the worker runtime nor the service's internals, and
matplotlib loads only for ``plot``. The launcher stays ``distune-run``.
"""

from __future__ import annotations

import argparse

from distune.errors import DistuneError


class CommandError(DistuneError):
    """A failure the user must fix (no service, a bad log file); ``distune`` prints its message
    on one line and exits with status 1, without a traceback."""


def path_argument(text: str) -> str:
    """An argparse type for a file or directory argument: not empty (``Path("")`` is ``.``,
    which the error would then name, a path never typed: a variable left empty)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"must be a path, got {text!r}")
    return text
