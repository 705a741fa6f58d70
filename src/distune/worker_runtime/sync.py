"""Sync points: where every rank learns the slowest rank's time and the leader's decision.

A sync point falls at the end of a synchronised backward whose iteration number every rank
knows in advance: the previous sync point's decision says how many iterations away the next one
is. At a sync point all ranks join ONE ``all_reduce(MAX)`` of a small float64 tensor::

    [seconds, group_id, bucket_size_2p, is_hierarchical_reduce, iterations_to_next, completed]

Every rank writes its own ``seconds`` (its wall-clock time for the window just closed), so the
maximum is the slowest rank's. Only the leader (rank 0) writes the decision fields; the others
write -1, below any value the leader writes, so the maximum is the leader's decision. Every
rank then applies the decision before the next forward, so all switch at the same iteration.

The leader picks ``iterations_to_next`` (:class:`WindowSchedule`) so that windows last about
``sync_interval`` seconds whatever the step time, growing at most fourfold per window so one
window that reads fast (a timer straddling a pause) is not followed by a very long one. A switch
is the exception: the new group's speed is unknown (a hopeless group can be a thousand times
slower than the one before), so the window after a switch lasts ONE iteration, and the next
is sized from that iteration's time, at most as long as the window before the switch. A new
group thus costs at most a few of its own iterations before the service sees a window of it.
After the decision marked ``completed`` is applied, sync points stop: the group is final, and
nothing more is measured.
"""

from __future__ import annotations

import logging
import math
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from distune.space import Hyperparameters
from distune.worker_runtime.leader_client import LeaderClient, WindowReport
from distune.worker_runtime.meter import Window, WindowMeter

logger = logging.getLogger(__name__)

#: What non-leaders write in the decision fields: below anything the leader writes.
_PLACEHOLDER = -1.0
#: At most this many times the previous window's iterations in the next window.
MAX_GROWTH = 4
#: Iterations of the window right after a switch: the new group's speed is not known yet.
SWITCH_WINDOW = 1


@dataclass(frozen=True)
class Decision:
    """The leader's decision at a sync point.

    ``group_id`` is the service's id of ``hyperparameters`` (``None`` while the service has not
    answered); ``completed`` says tuning is over and the group is final.
    """

    group_id: int | None
    hyperparameters: Hyperparameters
    iterations_to_next: int
    completed: bool = False

    def __post_init__(self) -> None:
        if self.iterations_to_next < 1:
            raise ValueError(f"iterations_to_next must be >= 1, got {self.iterations_to_next}")


@dataclass(frozen=True)
class Agreement:
    """What every rank knows after a sync point: the slowest rank's seconds and the decision."""

    slowest_seconds: float
    decision: Decision


def encode(seconds: float, decision: Decision | None) -> list[float]:
    """This rank's contribution: its seconds, and the decision if it is the leader."""
    if decision is None:
        return [seconds] + [_PLACEHOLDER] * 5
    hp = decision.hyperparameters
    group_id = _PLACEHOLDER if decision.group_id is None else float(decision.group_id)
    return [
        seconds,
        group_id,
        float(hp.bucket_size_2p),
        float(hp.is_hierarchical_reduce),
        float(decision.iterations_to_next),
        float(decision.completed),
    ]


def decode(values: list[float]) -> Agreement:
    """The agreement from the reduced tensor's values."""
    seconds, group_id, bucket_2p, hierarchical, iterations, completed = values
    if bucket_2p < 0:
        raise RuntimeError("sync point: no rank contributed a decision (is rank 0 tuning?)")
    decision = Decision(
        group_id=None if group_id < 0 else int(group_id),
        hyperparameters=Hyperparameters(int(bucket_2p), hierarchical > 0),
        iterations_to_next=int(iterations),
        completed=completed > 0,
    )
    return Agreement(seconds, decision)


def exchange(
    process_group: dist.ProcessGroup,
    device: torch.device,
    seconds: float,
    decision: Decision | None,
) -> Agreement:
    """The sync-point collective: every rank calls it; only the leader passes a decision."""
    tensor = torch.tensor(encode(seconds, decision), dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=process_group)
    return decode(tensor.tolist())


def iterations_to_next(
    seconds: float, iterations: int, sync_interval: float, ceiling: int = 0
) -> int:
    """Iterations the next window should last to take about ``sync_interval`` seconds, after a
    window of ``iterations`` that took ``seconds``: at most ``MAX_GROWTH`` times as many, or
    ``ceiling`` where that is more."""
    if not (math.isfinite(seconds) and seconds > 0):
        return iterations
    target = round(sync_interval * iterations / seconds)
    return max(1, min(target, max(MAX_GROWTH * iterations, ceiling)))


class WindowSchedule:
    """How many iterations each window lasts: the leader's side of the schedule (every rank
    learns the result at the sync point, so all know the next one's iteration in advance).

    After a switch the window is :data:`SWITCH_WINDOW` iterations long; the window after it is
    sized from its time, with the window before the switch as the ceiling of its growth (its
    time includes the switch's own cost, so it reads slow: the next window comes out no longer
    than ``sync_interval``). Otherwise windows aim at ``sync_interval``
    (:func:`iterations_to_next`).
    """

    def __init__(self, sync_interval: float) -> None:
        self.sync_interval = sync_interval
        self._ceiling = 0

    def next(self, window: Window, switching: bool) -> int:
        """Iterations of the window after ``window``; ``switching``: the group changes now."""
        if switching:
            # Switches in a row (a sample ended at its first window) keep the earlier ceiling.
            self._ceiling = max(self._ceiling, window.iterations)
            return SWITCH_WINDOW
        iterations = iterations_to_next(
            window.seconds, window.iterations, self.sync_interval, self._ceiling
        )
        self._ceiling = 0
        return iterations


class SyncPoints:
    """The sync-point schedule of one tuned model on one rank.

    :meth:`after_iteration` runs at the end of every synchronised backward. The first one opens
    the first window (one iteration long); at each sync point the window closes, the ranks
    agree, the leader hands the window to its ``client``, and every rank returns the decided
    hyperparameters for its reducer to switch to. ``client`` is set on the leader only; it is
    closed when tuning stops or this object is dropped (nothing here refers back to the
    reducer or the wrapper, so a dropped wrapper is freed at once, on every rank alike).
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup,
        device: torch.device,
        client: LeaderClient | None,
        hyperparameters: Hyperparameters,
        sync_interval: float,
    ) -> None:
        self._process_group = process_group
        self._device = device
        self._client = client
        self._hyperparameters = hyperparameters
        self._schedule = WindowSchedule(sync_interval)
        if client is not None:
            weakref.finalize(self, client.close)
        self._meter = WindowMeter(device)
        self._group_id: int | None = None
        self._next_at: int | None = None
        self.stopped = False

    def stop(self) -> None:
        """No more sync points (every rank must stop at the same iteration)."""
        self.stopped = True
        if self._client is not None:
            self._client.close()

    def after_iteration(self, iteration: int) -> Hyperparameters | None:
        """Called after synchronised backward number ``iteration`` on every rank; returns the
        hyperparameters to switch to before the next forward, or ``None`` to keep them."""
        if self.stopped:
            return None
        if self._next_at is None:
            self._meter.start(iteration)
            self._next_at = iteration + 1
            return None
        if iteration < self._next_at:
            return None
        window = self._meter.stop(iteration)
        decision = None
        if self._client is not None:
            answer = self._client.latest()
            hyperparameters = self._hyperparameters if answer is None else answer.hyperparameters
            decision = Decision(
                group_id=None if answer is None else answer.group_id,
                hyperparameters=hyperparameters,
                iterations_to_next=self._schedule.next(
                    window, switching=hyperparameters != self._hyperparameters
                ),
                # A model the service refused is not tuned: every rank stops at this point.
                completed=self._client.refused or (answer is not None and answer.completed),
            )
        agreement = exchange(self._process_group, self._device, window.seconds, decision)
        if self._client is not None and self._group_id is not None:
            self._client.report(
                WindowReport(
                    group_id=self._group_id,
                    train_iter=iteration,
                    iterations=window.iterations,
                    seconds=agreement.slowest_seconds,
                )
            )
        agreed = agreement.decision
        switch = None
        if agreed.hyperparameters != self._hyperparameters:
            logger.info(
                "iteration %d: switching to %s (group %s)",
                iteration,
                agreed.hyperparameters.describe(),
                agreed.group_id,
            )
            switch = self._hyperparameters = agreed.hyperparameters
        self._group_id = agreed.group_id
        if agreed.completed:
            logger.info(
                "tuning completed: keeping %s from iteration %d",
                agreed.hyperparameters.describe(),
                iteration,
            )
            self.stop()
            return switch
        self._next_at = iteration + agreed.iterations_to_next
        self._meter.start(iteration)
        return switch
