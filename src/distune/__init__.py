"""distune: PyTorch data-parallel training that tunes its own communication settings online.

The torch-backed names (``DistributedDataParallel``) are imported lazily, on first use, so that
importing ``distune`` (as the tuning service does) never pulls in torch.
"""

from __future__ import annotations

from importlib import import_module, metadata
from typing import TYPE_CHECKING, Any

from distune.space import Hyperparameters

if TYPE_CHECKING:
    from distune.worker_runtime import DistributedDataParallel
    from distune.worker_runtime.prepare import Prepared, prepare

__version__ = metadata.version("distune")
__all__ = ["DistributedDataParallel", "Hyperparameters", "Prepared", "__version__", "prepare"]

_LAZY = {
    "DistributedDataParallel": "distune.worker_runtime",
    "prepare": "distune.worker_runtime.prepare",
    "Prepared": "distune.worker_runtime.prepare",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'distune' has no attribute {name!r}")
