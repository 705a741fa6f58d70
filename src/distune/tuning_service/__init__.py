"""The HTTP tuning service: per-model tuning sessions (a state machine over report windows),
a scikit-optimize Gaussian-process optimizer, the CSV log, and the REST API v1
(docs/architecture.md places it among the parts; docs/tuning_service.md is its how).

Run it with ``python -m distune.tuning_service``. :class:`TuningConfig` is cheap to import (the
launcher takes its flag defaults from it); the rest loads Flask and scikit-optimize, so it is
imported on first use. This package never imports torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from distune.tuning_service.config import OptimizerSettings, TuningConfig

if TYPE_CHECKING:
    from distune.tuning_service.app import create_app
    from distune.tuning_service.service import TuningService
    from distune.tuning_service.session import TuningSession

__all__ = ["OptimizerSettings", "TuningConfig", "TuningService", "TuningSession", "create_app"]

_LAZY = {
    "TuningService": "distune.tuning_service.service",
    "TuningSession": "distune.tuning_service.session",
    "create_app": "distune.tuning_service.app",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'distune.tuning_service' has no attribute {name!r}")
