"""``distune.data``: data samplers for data-parallel training.

``LoadBalancingDistributedSampler`` is a drop-in for ``torch.utils.data.DistributedSampler``
that gives every rank batches of about equal cost when samples differ in cost (sequence
lengths), so no rank waits for another's long batch at every step.
"""

from distune.worker_runtime.load_balancing_sampler import (
    LoadBalancingDistributedSampler,
    SamplerError,
)

__all__ = ["LoadBalancingDistributedSampler", "SamplerError"]
