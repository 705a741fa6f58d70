"""The best-file: the chosen groups as JSON, written when a model completes.

Its top-level keys are launcher config keys, so ``distune-run --autotune_config BEST_FILE``
runs the next job with the tuned settings fixed::

    {"bucket_size": 4194304, "hierarchical_reduce": false,
     "autotune_result": {"models": {"model0": {"group": G, "score": 812.5,
         "default_score": 700.1, "gain_vs_default": 0.16, "gain_margin": 0.03,
         "verdict": "+16.0% vs the default (95% interval +13.0% to +19.0%)", "samples": 14}}}}

The knob keys are present only when the service tunes exactly one model, and that model's
choice is of its latest registration: with several models, no single job-wide setting fits them
all, and a model registered again with other facts (unfrozen layers, other nodes) is in a shape
its earlier choice was not made for. The file is replaced atomically (a new file with mode
0600, renamed over the old one), so a reader never sees half of it; an explicit path that is a
symbolic link is refused.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from distune.errors import DistuneError
from distune.tuning_service.session import SessionView, State


class BestFileError(DistuneError, OSError):
    """The best-file cannot be written where asked; the message says why."""


def check_path(path: Path) -> None:
    """Refuse a path that is a symbolic link or whose directory does not exist."""
    if path.is_symlink():
        raise BestFileError(f"refusing to write the best-file to {path}: it is a symbolic link")
    if not path.parent.is_dir():
        raise BestFileError(f"cannot write the best-file to {path}: no such directory")
    if path.exists() and not path.is_file():
        raise BestFileError(f"cannot write the best-file to {path}: not a regular file")


def best_document(views: Sequence[SessionView], settings: bool = True) -> dict[str, Any]:
    """The best-file's JSON for the completed models among ``views`` (all registered models).
    ``settings`` False leaves the knob keys out: the choice is of an earlier registration of
    the model (another shape), which would not fit the next job."""
    models = {}
    for view in views:
        if view.state is not State.COMPLETED or view.best is None:
            continue
        models[view.name] = {
            "group": view.best.group.to_dict(),
            "score": view.best.score,
            "default_score": view.default_score,
            "gain_vs_default": view.best.gain_vs_default,
            "gain_margin": view.best.gain_margin,
            "verdict": view.verdict,
            "samples": view.samples,
        }
    document: dict[str, Any] = {}
    if settings and len(views) == 1 and models:
        hp = views[0].best.group.hyperparameters  # type: ignore[union-attr]
        document["bucket_size"] = hp.bucket_size
        document["hierarchical_reduce"] = hp.is_hierarchical_reduce
    document["autotune_result"] = {"models": models}
    return document


def write_best_file(path: Path, views: Sequence[SessionView], settings: bool = True) -> None:
    """Replace ``path`` atomically with :func:`best_document` of ``views``."""
    check_path(path)
    text = json.dumps(best_document(views, settings), indent=2, sort_keys=True) + "\n"
    fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        # os.replace renames over a link rather than following it, should one appear meanwhile.
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
