"""Which group a model starts on, and the search space it is tuned in.

The same rule the service applies, so the job runs the service's default group before any HTTP
answer arrives:

1. a constructor argument that is not ``None`` (``bucket_size`` in bytes or torch's
   ``bucket_cap_mb``, ``hierarchical``) pins that knob for this model; the leader sends it to the
   service as register's ``fixed``;
2. otherwise ``DISTUNE_BUCKET_SIZE`` / ``DISTUNE_HIERARCHICAL_REDUCE`` pin it job-wide (the
   launcher gives the service the same knobs as ``--fixed``);
3. the rest comes from ``SearchSpace.for_model(facts, fixed, DISTUNE_DEFAULT_BUCKET_SIZE).default``.

Bucket sizes in bytes are rounded to the nearest power of two (``space.bucket_size_2p_for``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from distune.space import FixedKnobs, ModelFacts, SearchSpace, bucket_size_2p_for
from distune.worker_runtime.topology import Topology
from distune.worker_settings import WorkerSettings

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StartingGroup:
    """A model's facts, the knobs its constructor pinned (sent to the service) and its space,
    whose ``default`` is the group it starts on."""

    facts: ModelFacts
    pinned: FixedKnobs
    space: SearchSpace

    @classmethod
    def plan(
        cls,
        topology: Topology,
        gradient_bytes: int,
        bucket_size: int | None,
        hierarchical: bool | None,
        settings: WorkerSettings,
    ) -> StartingGroup:
        """Apply the precedence above."""
        facts = ModelFacts(
            topology.world_size, topology.nnodes, topology.local_world_size, gradient_bytes
        )
        pinned = FixedKnobs(
            None if bucket_size is None else bucket_size_2p_for(bucket_size), hierarchical
        )
        job_bucket = settings.bucket_size
        fixed = FixedKnobs(
            _first(
                pinned.bucket_size_2p,
                None if job_bucket is None else bucket_size_2p_for(job_bucket),
            ),
            _first(pinned.is_hierarchical_reduce, settings.hierarchical_reduce),
        )
        if fixed.is_hierarchical_reduce and not topology.hierarchical_possible:
            logger.info(
                "hierarchical allreduce asked for, but with %d node(s) of %d rank(s) it is flat "
                "allreduce: running flat",
                topology.nnodes,
                topology.local_world_size,
            )
        return cls(facts, pinned, SearchSpace.for_model(facts, fixed, settings.default_bucket_size))


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)
