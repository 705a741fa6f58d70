"""``distune.algorithms``: how the ranks' models are kept in step (see
:mod:`distune.worker_runtime.algorithms`)."""

from distune.worker_runtime.algorithms import (
    Algorithm,
    AlgorithmError,
    AsyncModelAverage,
    Decentralized,
    GradientAllReduce,
    LowPrecision,
    ModelAveragingError,
)

__all__ = [
    "Algorithm",
    "AlgorithmError",
    "AsyncModelAverage",
    "Decentralized",
    "GradientAllReduce",
    "LowPrecision",
    "ModelAveragingError",
]
