"""``GradientAllReduce``: the engine's bucketed, overlapping allreduce of gradients (default)."""

from __future__ import annotations

from dataclasses import dataclass

from distune.worker_runtime.algorithms.base import Algorithm


@dataclass(frozen=True)
class GradientAllReduce(Algorithm):
    """Centralized synchronous data parallelism: gradients averaged exactly at every step, as
    torch DDP does; bucket size and flat/hierarchical allreduce are tuned.

    The default algorithm, and the one to use unless the network is the bottleneck: every rank
    trains the same model on the exact average gradient.
    """

    uses_bucket_size = True
    uses_hierarchical = True
