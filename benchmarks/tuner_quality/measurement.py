"""Noisy measurements of a landscape: what a tuner sees when a job runs a group.

A job reports windows between sync points whose lengths follow the worker's own schedule
(:class:`distune.worker_runtime.sync.WindowSchedule`): each window's iterations are decided at
the sync point before it from the window just closed, aiming at ``window_seconds`` (the
worker's sync interval); after a switch the window lasts one iteration and costs the switch's
``switch_seconds`` on top. The leader applies the service's answers late, as the worker's
leader does (:class:`LaggedAnswers`): at a sync point it acts on the answers that arrived
during the window just closed, never on the answer to the report it posts there.

Each window's throughput is the group's true throughput times three kinds of multiplicative
noise:

- per window, log-normal with ``window_sigma`` (step-time jitter), larger for a window shorter
  than ``window_seconds`` (by the square root of the ratio, at most threefold);
- per measurement period, log-normal with ``period_sigma`` (slower drifts: other jobs on the
  network, thermal state), redrawn whenever the job switches group;
- rare outlier windows: with ``stall_rate`` a stall (data loader, checkpoint) slows a window by
  a factor drawn from ``stall_slowdown``; with ``lucky_rate`` a window reads ``lucky_speedup``
  too fast (a timer straddling a pause).

The noise is seeded by the landscape's name and the seed together: two landscapes' runs with the
same seed draw independent noise. Seeded by the seed alone, every landscape's seed-k run would
share one sequence of draws (common random numbers), so one lucky draw (a default's first
sample read high) would fail the k-th run of every landscape at once, and a draw's percentiles
would rest on far fewer independent runs than they count.
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass
from typing import Generic, TypeVar

from benchmarks.tuner_quality.landscapes import Landscape
from distune.space import Hyperparameters
from distune.worker_runtime.meter import Window
from distune.worker_runtime.sync import SWITCH_WINDOW, WindowSchedule

T = TypeVar("T")


@dataclass(frozen=True)
class NoiseModel:
    """The noise of the module's docstring (defaults: a few percent, as on real clusters)."""

    window_sigma: float = 0.03
    period_sigma: float = 0.01
    stall_rate: float = 0.03
    stall_slowdown: tuple[float, float] = (1.3, 3.0)
    lucky_rate: float = 0.01
    lucky_speedup: float = 1.25
    #: The worker's sync interval: what windows aim at.
    window_seconds: float = 1.0
    #: What applying a new group costs the switch's window (buckets rebuilt, buffers allocated).
    switch_seconds: float = 0.02
    #: How long after a report its answer reaches the leader (HTTP, the service's choice of the
    #: next group): an answer is applied at the first sync point at least this much later.
    answer_seconds: float = 0.1


class SimulatedJob:
    """A training job on ``landscape`` that reports windows of whatever group it runs; its noise
    is drawn from ``seed`` and the landscape's name together (see the module's docstring)."""

    def __init__(self, landscape: Landscape, noise: NoiseModel, seed: int) -> None:
        self.landscape = landscape
        self.noise = noise
        # A string seed is hashed (SHA-512) into the generator's state: reproducible across
        # processes and Python runs, unlike hash() of a tuple.
        self._rng = random.Random(f"{landscape.name}/{seed}")
        self._group: Hyperparameters | None = None
        self._period = 1.0
        self._schedule = WindowSchedule(noise.window_seconds)
        self._last: Window | None = None
        self.train_iter = 0
        self.seconds = 0.0

    def window(self, hp: Hyperparameters) -> tuple[int, float]:
        """Run ``hp`` (the leader's decision at this sync point) for one window of the worker's
        schedule: (iterations, seconds)."""
        noise, rng = self.noise, self._rng
        switching = hp != self._group
        if self._last is None:
            iterations = SWITCH_WINDOW  # the worker's first window: one iteration
        else:
            iterations = self._schedule.next(self._last, switching)
        if switching:
            self._group = hp
            self._period = math.exp(rng.gauss(0.0, noise.period_sigma))
        rate = self.landscape.throughput[hp] * self._period
        # Step-time jitter averages out over a window: a window shorter than the sync interval
        # is noisier (up to three times, for the shortest).
        expected = iterations / rate
        spread = min(3.0, math.sqrt(noise.window_seconds / expected))
        rate *= math.exp(rng.gauss(0.0, noise.window_sigma * max(1.0, spread)))
        draw = rng.random()
        if draw < noise.stall_rate:
            rate /= rng.uniform(*noise.stall_slowdown)
        elif draw < noise.stall_rate + noise.lucky_rate:
            rate *= noise.lucky_speedup
        seconds = iterations / rate + (noise.switch_seconds if switching else 0.0)
        self._last = Window(iterations, seconds)
        self.train_iter += iterations
        self.seconds += seconds
        return iterations, seconds

    def measure(self, hp: Hyperparameters, seconds: float, min_windows: int) -> list[float]:
        """Switch to ``hp``, discard the first window, then measure for at least ``seconds``
        and ``min_windows`` windows, as the service does; the windows' rates."""
        self.window(hp)
        rates: list[float] = []
        measured = 0.0
        while measured < seconds or len(rates) < min_windows:
            iterations, window_seconds = self.window(hp)
            rates.append(iterations / window_seconds)
            measured += window_seconds
        return rates


class LaggedAnswers(Generic[T]):
    """The service's answers as the worker's leader sees them: an answer to a report posted at
    a sync point is applied at a later sync point, the first at least ``delay`` seconds of job
    time after the post (the leader reads its latest answer before posting the window)."""

    def __init__(self, first: T, delay: float) -> None:
        self._latest = first
        self._delay = delay
        self._pending: deque[tuple[float, T]] = deque()

    def post(self, now: float, answer: T) -> None:
        """The answer to the report posted at job time ``now``."""
        self._pending.append((now, answer))

    def latest(self, now: float) -> T:
        """The answer the leader acts on at the sync point at job time ``now``."""
        while self._pending and (
            self._pending[0][0] < now and self._pending[0][0] + self._delay <= now
        ):
            self._latest = self._pending.popleft()[1]
        return self._latest
