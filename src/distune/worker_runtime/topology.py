"""Which node every rank runs on, and the process groups hierarchical allreduce needs.

The topology is gathered from the ranks themselves: each one contributes its node id
(``GROUP_RANK``, which torchrun and ``distune-run`` set to the node's rank) and its
``LOCAL_RANK``, which only orders a node's ranks (torchrun's ``--virtual-local-rank`` gives
every rank 0; the global rank breaks the tie). Nothing is inferred from hostnames. Where a
launcher sets neither variable (``mp.spawn``, a hand-written launch), the job is taken to be
one node, on which hierarchical allreduce is flat allreduce anyway.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from distune.errors import DistuneError

logger = logging.getLogger(__name__)

#: Environment variables a launcher sets for every worker (torchrun's names).
NODE_VAR = "GROUP_RANK"
LOCAL_RANK_VAR = "LOCAL_RANK"


class TopologyError(DistuneError, RuntimeError):
    """The ranks reported an impossible topology; the message says what was reported."""


@dataclass(frozen=True)
class Topology:
    """The node id and local rank of every rank of a process group, indexed by group rank."""

    rank: int
    nodes: tuple[int, ...]
    local_ranks: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.nodes) != len(self.local_ranks):
            raise ValueError("one node id and one local rank per rank")

    @property
    def world_size(self) -> int:
        """Number of ranks."""
        return len(self.nodes)

    @property
    def node_ids(self) -> tuple[int, ...]:
        """The distinct node ids, ascending."""
        return tuple(sorted(set(self.nodes)))

    def members(self, node: int) -> tuple[int, ...]:
        """Group ranks on ``node``, by local rank, then rank (the first one is the node's
        leader)."""
        ranks = [r for r in range(self.world_size) if self.nodes[r] == node]
        return tuple(sorted(ranks, key=lambda r: (self.local_ranks[r], r)))

    @property
    def uniform(self) -> bool:
        """Whether every node runs the same number of ranks."""
        return len({len(self.members(node)) for node in self.node_ids}) == 1

    @property
    def nnodes(self) -> int:
        """Nodes as the search space counts them (see :attr:`local_world_size`)."""
        return len(self.node_ids) if self.uniform else self.world_size

    @property
    def local_world_size(self) -> int:
        """Ranks per node; a job with unequal nodes counts as nodes of one rank each, so that
        hierarchical allreduce (defined for equal nodes) is not offered."""
        return self.world_size // len(self.node_ids) if self.uniform else 1

    @property
    def hierarchical_possible(self) -> bool:
        """Hierarchical allreduce differs from flat only with several multi-rank nodes."""
        return self.nnodes > 1 and self.local_world_size > 1

    def as_single_rank_nodes(self) -> Topology:
        """The same ranks seen as nodes of one rank each: no hierarchical allreduce."""
        return Topology(self.rank, tuple(range(self.world_size)), (0,) * self.world_size)


def discover(
    process_group: dist.ProcessGroup,
    device: torch.device,
    environ: Mapping[str, str] | None = None,
) -> Topology:
    """Gather every rank's (node id, local rank) with one all_gather over ``process_group``.

    ``device`` is where the group's collectives run (CUDA for NCCL). A collective: every rank
    of the group calls it.
    """
    environ = os.environ if environ is None else environ
    mine = torch.tensor(
        [_read_int(environ, NODE_VAR), _read_int(environ, LOCAL_RANK_VAR)],
        dtype=torch.int64,
        device=device,
    )
    world_size = dist.get_world_size(process_group)
    gathered = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(gathered, mine, group=process_group)
    rows = [tuple(int(v) for v in t.tolist()) for t in gathered]
    rank = dist.get_rank(process_group)
    if any(node < 0 or local < 0 for node, local in rows):
        # Some launcher did not say where its ranks run: assume one node.
        return Topology(rank, (0,) * world_size, tuple(range(world_size)))
    return Topology(rank, tuple(r[0] for r in rows), tuple(r[1] for r in rows))


def _read_int(environ: Mapping[str, str], name: str) -> int:
    text = environ.get(name, "").strip()
    if not text:
        return -1
    try:
        value = int(text)
    except ValueError:
        raise TopologyError(f"{name} must be a non-negative integer, got {text!r}") from None
    if value < 0:
        raise TopologyError(f"{name} must be a non-negative integer, got {value}")
    return value


@dataclass(frozen=True)
class HierarchicalProcessGroups:
    """The process groups of hierarchical allreduce, as this rank sees them.

    ``intra`` holds the ranks of this rank's node and ``leader`` is the global rank of its
    leader (lowest local rank); ``leaders`` joins the node leaders and is ``None`` on the others.
    """

    intra: dist.ProcessGroup
    leader: int
    leaders: dist.ProcessGroup | None

    @property
    def is_leader(self) -> bool:
        """Whether this rank is its node's leader."""
        return self.leaders is not None

    @classmethod
    def build(
        cls, topology: Topology, process_group: dist.ProcessGroup
    ) -> HierarchicalProcessGroups:
        """Create one process group per node and one of the leaders: once, at construction.

        ``torch.distributed.new_group`` is collective over the whole job, so every rank creates
        every group, in the same order. ``process_group`` must span the whole job.
        """
        if dist.get_world_size(process_group) != dist.get_world_size():
            raise TopologyError(
                "hierarchical allreduce needs a process group spanning the whole job"
            )

        def global_ranks(group_ranks: tuple[int, ...]) -> list[int]:
            return [dist.get_global_rank(process_group, r) for r in group_ranks]

        intra = None
        leader = -1
        for node in topology.node_ids:
            members = topology.members(node)
            node_process_group = dist.new_group(global_ranks(members))
            if topology.rank in members:
                intra, leader = node_process_group, global_ranks(members)[0]
        leader_ranks = tuple(topology.members(node)[0] for node in topology.node_ids)
        leaders = dist.new_group(global_ranks(leader_ranks))
        assert intra is not None  # every rank is on some node
        return cls(intra, leader, leaders if topology.rank in leader_ranks else None)
