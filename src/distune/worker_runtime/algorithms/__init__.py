"""Ways of keeping the ranks' models in step, passed as
``DistributedDataParallel(..., algorithm=...)``.

* :class:`GradientAllReduce` (default): exact gradient average every step.
* :class:`LowPrecision`: gradient average over 8-bit (or 16-bit) compressed communication,
  with error feedback.
* :class:`Decentralized`: each rank averages its weights with one or two peers.
* :class:`AsyncModelAverage`: ranks never wait; weights averaged in the background.

torch DDP's communication hooks run through ``DistributedDataParallel.register_comm_hook``
(:mod:`.comm_hook`). The tuner never changes the algorithm; it tunes only the knobs the
algorithm uses (:attr:`Algorithm.uses_bucket_size`, :attr:`Algorithm.uses_hierarchical`).
"""

from distune.worker_runtime.algorithms.async_model_average import AsyncModelAverage
from distune.worker_runtime.algorithms.base import (
    Algorithm,
    AlgorithmError,
    ModelAveragingError,
)
from distune.worker_runtime.algorithms.decentralized import Decentralized
from distune.worker_runtime.algorithms.gradient_allreduce import GradientAllReduce
from distune.worker_runtime.algorithms.low_precision import LowPrecision

__all__ = [
    "Algorithm",
    "AlgorithmError",
    "AsyncModelAverage",
    "Decentralized",
    "GradientAllReduce",
    "LowPrecision",
    "ModelAveragingError",
]
