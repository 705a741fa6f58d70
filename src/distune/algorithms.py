"""``distune.algorithms``: how the ranks' models are kept in step (see
:mod:`distune.worker_runtime.algorithms`)."""

from distune.worker_runtime.algorithms import (
    Algorithm,
    AsyncModelAverage,
    Decentralized,
    GradientAllReduce,
    LowPrecision,
)

__all__ = [
    "Algorithm",
    "AsyncModelAverage",
    "Decentralized",
    "GradientAllReduce",
    "LowPrecision",
]
