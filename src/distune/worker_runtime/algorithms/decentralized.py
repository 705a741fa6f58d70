"""``Decentralized``: each rank averages its model with a few peers instead of all ranks.

Decentralized synchronous SGD (D-PSGD): every ``interval`` steps, rank ``r`` sends its weights
``x_r`` to its peers and receives theirs; its next weights are the average of its group (itself
and its peers) plus its own local update: ``x_r <- mean(x_j for j in {r} + peers) - lr * g_r``.
Gradients are never averaged. The exchange starts before the forward and is applied before the
next forward, so it overlaps the whole forward, backward and optimizer step.

Peers: ``"ring"``: the two ring neighbours ``r - 1`` and ``r + 1``; ``"shift_one"``: a single
peer that changes every exchange, ranks paired by a round-robin schedule (every pair meets once
in ``n - 1`` exchanges; with an odd number of ranks one rank sits each round out). The sum is
taken in rank order, so ranks with the same group compute bit-identical averages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from distune.checks import InvalidValue, integer_in
from distune.worker_runtime.algorithms.base import Algorithm, AlgorithmError, ModelAverager
from distune.worker_runtime.algorithms.flat_params import FlatParams

_PEER_SELECTIONS = ("ring", "shift_one")


@dataclass(frozen=True)
class Decentralized(Algorithm):
    """Model averaging with peers every ``interval`` steps (Bagua's decentralized SGD).

    Args:
        peer_selection: ``"ring"`` (both ring neighbours) or ``"shift_one"`` (one peer,
            changing every exchange).
        interval: steps between exchanges (1: every step).

    Trades: each rank sends its weights to one or two peers instead of an allreduce of all
    gradients, and no collective spans every rank, so a slow link or a slow rank holds back
    only its neighbours; the models differ between ranks and converge more slowly per step
    (information spreads over the ring in ``n / 2`` exchanges). For many ranks on a slow or
    uneven network. Bucket size and hierarchical allreduce are not used (not tuned).
    """

    peer_selection: str = "ring"
    interval: int = 1
    uses_bucket_size = False
    uses_hierarchical = False

    def __post_init__(self) -> None:
        if self.peer_selection not in _PEER_SELECTIONS:
            raise AlgorithmError(
                f"peer_selection must be one of {', '.join(_PEER_SELECTIONS)}, got "
                f"{self.peer_selection!r}"
            )
        try:
            integer_in(self.interval, 1, 2**31)
        except InvalidValue as error:
            raise AlgorithmError(f"Decentralized interval (steps) {error}") from None

    @property
    def averages_gradients(self) -> bool:
        """False: weights are averaged with peers, gradients stay local."""
        return False

    def model_averager(
        self, params: Sequence[torch.Tensor], process_group: dist.ProcessGroup
    ) -> ModelAverager:
        """The peer exchange for ``params`` over ``process_group``'s ranks."""
        return DecentralizedAverager(params, process_group, self.peer_selection, self.interval)


def peers(rank: int, world_size: int, peer_selection: str, exchange: int) -> list[int]:
    """Group ranks (not ``rank`` itself) ``rank`` averages with at its ``exchange``-th
    exchange, sorted."""
    if world_size == 1:
        return []
    if peer_selection == "ring":
        return sorted({(rank - 1) % world_size, (rank + 1) % world_size} - {rank})
    # Round-robin ("circle") schedule over an even number of seats; seat n of an odd n is empty.
    seats = world_size + world_size % 2
    rounds = seats - 1
    r = exchange % rounds
    if rank == seats - 1:
        partner = r
    elif rank == r:
        partner = seats - 1
    else:
        partner = (2 * r - rank) % rounds
    return [] if partner >= world_size else [partner]


class DecentralizedAverager(ModelAverager):
    """The :class:`Decentralized` exchange for one model."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        process_group: dist.ProcessGroup,
        peer_selection: str,
        interval: int,
    ) -> None:
        self._flat = FlatParams(params)
        ranks = dist.get_process_group_ranks(process_group)
        # Its own group, so point-to-point traffic never interleaves with the job's collectives.
        self._group = dist.new_group(ranks)
        self._ranks = ranks
        self._world = len(ranks)
        self._rank = dist.get_rank(process_group)
        self._peer_selection = peer_selection
        self._interval = interval
        self._steps = 0
        self._exchanges = 0
        self._pending: tuple[list[torch.Tensor], list[int], list[list[torch.Tensor]], Any] | None
        self._pending = None

    def before_forward(self) -> None:
        """Apply the previous exchange; start this step's, if it is an exchange step."""
        self._complete()
        if self._steps % self._interval == 0:
            self._begin()
        self._steps += 1

    def finish(self) -> None:
        """Apply the exchange still under way (every rank started it at the same step)."""
        self._complete()

    def _begin(self) -> None:
        members = peers(self._rank, self._world, self._peer_selection, self._exchanges)
        self._exchanges += 1
        if not members:
            return
        snapshot = self._flat.snapshot()
        received = [[torch.empty_like(t) for t in snapshot] for _ in members]
        ops = []
        for peer, buffers in zip(members, received, strict=True):
            for mine, theirs in zip(snapshot, buffers, strict=True):
                ops.append(dist.P2POp(dist.isend, mine, self._ranks[peer], self._group))
                ops.append(dist.P2POp(dist.irecv, theirs, self._ranks[peer], self._group))
        works = dist.batch_isend_irecv(ops)
        self._pending = (snapshot, members, received, works)

    def _complete(self) -> None:
        if self._pending is None:
            return
        snapshot, members, received, works = self._pending
        self._pending = None
        for work in works:
            work.wait()
        by_rank = dict(zip(members, received, strict=True))
        by_rank[self._rank] = snapshot
        order = sorted(by_rank)
        averaged = []
        for k in range(len(snapshot)):
            total = by_rank[order[0]][k].clone()
            for rank in order[1:]:
                total += by_rank[rank][k]
            averaged.append(total.div_(len(order)))
        self._flat.apply(snapshot, averaged)
