"""distune: PyTorch data-parallel training that tunes its own communication settings online.

The torch-backed names (``DistributedDataParallel``, ``fuse_optimizer``, ``prepare``, the
``algorithms`` and ``data`` modules) are imported lazily, on first use, so that importing
``distune`` (as the tuning service does) never pulls in torch.
"""

from __future__ import annotations

from importlib import import_module, metadata
from typing import TYPE_CHECKING, Any

from distune.space import Hyperparameters

if TYPE_CHECKING:
    from distune import algorithms, data
    from distune.worker_runtime import DistributedDataParallel
    from distune.worker_runtime.fused_optimizer import fuse_optimizer
    from distune.worker_runtime.prepare import Prepared, prepare

__version__ = metadata.version("distune")
__all__ = [
    "DistributedDataParallel",
    "Hyperparameters",
    "Prepared",
    "__version__",
    "algorithms",
    "data",
    "fuse_optimizer",
    "prepare",
]

_LAZY = {
    "DistributedDataParallel": "distune.worker_runtime",
    "fuse_optimizer": "distune.worker_runtime.fused_optimizer",
    "prepare": "distune.worker_runtime.prepare",
    "Prepared": "distune.worker_runtime.prepare",
}
#: Submodules that import torch, loaded on first attribute access.
_LAZY_MODULES = ("algorithms", "data")


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    if name in _LAZY_MODULES:
        return import_module(f"distune.{name}")
    raise AttributeError(f"module 'distune' has no attribute {name!r}")
