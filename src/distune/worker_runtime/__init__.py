"""The worker runtime: bucketed, overlapping gradient averaging that retunes itself in lockstep.

Every rank of a training job runs it inside :class:`DistributedDataParallel`; rank 0 also talks
to the tuning service. One module per concept: ``buckets`` (parameters to flat buckets),
``reducer`` (flat and hierarchical allreduce during backward), ``topology`` (nodes and process
groups), ``meter`` (window timing), ``sync`` (the sync-point collective), ``leader_client``
(rank 0's HTTP thread) and ``distributed`` (the public wrapper).
"""

from distune.worker_runtime.distributed import DistributedDataParallel

__all__ = ["DistributedDataParallel"]
