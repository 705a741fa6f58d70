"""``AsyncModelAverage``: ranks train without waiting; models averaged in the background.

No gradient is averaged and no training step waits for another rank. A background thread per
rank runs averaging *rounds* on a process group of its own: a round allreduces a copy of the
weights (taken between two iterations) and a stop flag. The training thread applies a finished
round before the next forward, as ``w <- w - snapshot + average``, keeping the local progress
made while the round ran (Bagua's asynchronous model average). A round starts when the previous
one has been applied and ``interval_seconds`` have passed since the previous one started.

Rounds are collectives: the ``k``-th round of every rank is the same allreduce, so a rank that
starts a round early waits for the others, in the background. Ending: each rank calls
``finish()`` when it stops training (ranks may stop at different steps). A finished rank keeps
joining rounds, with its final weights and its stop flag set, until a round finds every rank
stopped; in that last round every rank takes the average itself, so all end with identical
models and nobody waits for a round that will never come.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from distune.checks import InvalidValue, number_in
from distune.worker_runtime.algorithms.base import (
    Algorithm,
    AlgorithmError,
    ModelAverager,
    ModelAveragingError,
)
from distune.worker_runtime.algorithms.flat_params import FlatParams


@dataclass(frozen=True)
class AsyncModelAverage(Algorithm):
    """Asynchronous model averaging every ``interval_seconds`` (Bagua's async algorithm).

    Call ``model.finish()`` on every rank when it stops training: it returns once every rank
    has finished, with the same averaged model on all of them.

    Trades: no rank ever waits for another, so stragglers and slow links cost nothing per step;
    but the ranks train diverging models between rounds, which slows convergence per step the
    more the longer the interval. For heterogeneous or shared machines where ranks run at
    different speeds. Bucket size and hierarchical allreduce are not used (not tuned).
    """

    interval_seconds: float = 1.0
    uses_bucket_size = False
    uses_hierarchical = False

    def __post_init__(self) -> None:
        try:
            number_in(self.interval_seconds, 0, 1e9)
        except InvalidValue as error:
            raise AlgorithmError(f"AsyncModelAverage interval_seconds {error}") from None

    @property
    def averages_gradients(self) -> bool:
        """False: weights are averaged in the background, gradients stay local."""
        return False

    def model_averager(
        self, params: Sequence[torch.Tensor], process_group: dist.ProcessGroup
    ) -> ModelAverager:
        """The background averaging of ``params`` over ``process_group``'s ranks."""
        return AsyncAverager(params, process_group, float(self.interval_seconds))


class AsyncAverager(ModelAverager):
    """The :class:`AsyncModelAverage` rounds of one model."""

    def __init__(
        self, params: Sequence[torch.Tensor], process_group: dist.ProcessGroup, interval: float
    ) -> None:
        self._flat = FlatParams(params)
        self._devices = [group[0].device for group in self._flat.groups]
        ranks = dist.get_process_group_ranks(process_group)
        self._world = len(ranks)
        # Its own group (and gloo, whatever the job's backend: the rounds run on CPU copies),
        # so background rounds never interleave with the training thread's collectives.
        self._group = dist.new_group(ranks, backend="gloo")
        self._interval = interval
        self._last_start = time.monotonic()
        self._lock = threading.Condition()
        self._request: list[torch.Tensor] | None = None  # the snapshot of the round asked for
        self._stopping = False
        self._result: tuple[list[torch.Tensor], bool] | None = None  # (average, all stopped)
        self._error: BaseException | None = None
        self._snapshot: list[torch.Tensor] | None = None  # the round in flight's snapshot
        self.finished = False
        #: Rounds applied so far (the last one included once ``finish`` has returned).
        self.rounds = 0
        self._thread = threading.Thread(
            target=self._rounds, name="distune-async-average", daemon=True
        )
        self._thread.start()

    def before_forward(self) -> None:
        """Apply a finished round; start the next when the interval has passed."""
        if self.finished:
            raise ModelAveragingError("finish() was called: this model no longer trains")
        with self._lock:
            self._raise_error()
            done, self._result = self._result, None
        if done is not None:
            assert self._snapshot is not None
            self._flat.apply(self._snapshot, done[0])
            self._snapshot = None
            self.rounds += 1
        if self._snapshot is None and time.monotonic() - self._last_start >= self._interval:
            self._start_round(stopping=False)

    def finish(self) -> None:
        """Join rounds with this rank's final weights until every rank has finished; the last
        round's average becomes every rank's model."""
        if self.finished:
            return
        while True:
            if self._snapshot is None:
                self._start_round(stopping=True)
            average, all_stopped = self._wait_result()
            assert self._snapshot is not None
            self.rounds += 1
            if all_stopped:
                self._flat.assign(average)
                self._snapshot = None
                break
            self._flat.apply(self._snapshot, average)
            self._snapshot = None
        with self._lock:
            self.finished = True
            self._lock.notify_all()
        self._thread.join()

    def _start_round(self, stopping: bool) -> None:
        self._snapshot = self._flat.snapshot()
        self._last_start = time.monotonic()
        with self._lock:
            # Copies: the allreduce works in place, and the snapshot must stay as it was.
            self._request = [t.to("cpu", copy=True) for t in self._snapshot]
            self._stopping = stopping
            self._lock.notify_all()

    def _wait_result(self) -> tuple[list[torch.Tensor], bool]:
        with self._lock:
            while self._result is None and self._error is None:
                self._lock.wait()
            self._raise_error()
            assert self._result is not None
            result, self._result = self._result, None
        return result

    def _raise_error(self) -> None:
        if self._error is not None:
            raise ModelAveragingError("background model averaging failed") from self._error

    def _rounds(self) -> None:
        try:
            while True:
                with self._lock:
                    while self._request is None and not self.finished:
                        self._lock.wait()
                    if self._request is None:
                        return
                    buffers, stopping = self._request, self._stopping
                    self._request = None
                flag = torch.tensor([1.0 if stopping else 0.0])
                dist.all_reduce(flag, group=self._group)
                for buffer in buffers:
                    dist.all_reduce(buffer, group=self._group)
                    buffer.div_(self._world)
                all_stopped = int(flag.item()) == self._world
                average = [b.to(device) for b, device in zip(buffers, self._devices, strict=True)]
                with self._lock:
                    self._result = (average, all_stopped)
                    self._lock.notify_all()
        except BaseException as error:  # surfaced on the training thread
            with self._lock:
                self._error = error
                self._lock.notify_all()
