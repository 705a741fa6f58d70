"""The exceptions every part of distune shares, and the base of all of its own.

Every exception distune raises on purpose derives from :class:`DistuneError`, so a caller can
catch distune's failures apart from everyone else's. Those that stand for a bad value also
derive from ``ValueError`` (``OSError``, ``LookupError``, ``RuntimeError`` where that is what
they are), so code written against the builtin classes keeps working.

The two errors more than one part raises live here, once; each part's other errors live
beside the code that raises them. docs/architecture.md lists them with the parts.
This module imports nothing, so every part (the torch-free service included) may import it.
"""

from __future__ import annotations


class DistuneError(Exception):
    """Base of every exception distune raises on purpose."""


class ConfigError(DistuneError, ValueError):
    """A setting (a flag, a config-file key, a tuning setting) holds a value it may not, or a
    config file cannot be read; the message names the setting and what is allowed."""


class ServiceError(DistuneError):
    """The tuning service cannot be reached or gave no usable answer; the message says which
    and why (never the token)."""
