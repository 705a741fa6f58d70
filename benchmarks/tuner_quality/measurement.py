"""Noisy measurements of a landscape: what a tuner sees when a job runs a group.

A job reports windows of about ``window_seconds``. Each window's throughput is the group's true
throughput times three kinds of multiplicative noise:

- per window, log-normal with ``window_sigma`` (step-time jitter);
- per measurement period, log-normal with ``period_sigma`` (slower drifts: other jobs on the
  network, thermal state), redrawn whenever the job switches group;
- rare outlier windows: with ``stall_rate`` a stall (data loader, checkpoint) slows a window by
  a factor drawn from ``stall_slowdown``; with ``lucky_rate`` a window reads ``lucky_speedup``
  too fast (a timer straddling a pause).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from benchmarks.tuner_quality.landscapes import Landscape
from distune.space import Hyperparameters


@dataclass(frozen=True)
class NoiseModel:
    """The noise of the module's docstring (defaults: a few percent, as on real clusters)."""

    window_sigma: float = 0.03
    period_sigma: float = 0.01
    stall_rate: float = 0.03
    stall_slowdown: tuple[float, float] = (1.3, 3.0)
    lucky_rate: float = 0.01
    lucky_speedup: float = 1.25
    window_seconds: float = 1.0


class SimulatedJob:
    """A training job on ``landscape`` that reports windows of whatever group it runs."""

    def __init__(self, landscape: Landscape, noise: NoiseModel, seed: int) -> None:
        self.landscape = landscape
        self.noise = noise
        self._rng = random.Random(seed)
        self._group: Hyperparameters | None = None
        self._period = 1.0
        self.train_iter = 0
        self.seconds = 0.0

    def window(self, hp: Hyperparameters) -> tuple[int, float]:
        """Run ``hp`` for one window: (iterations, seconds)."""
        noise, rng = self.noise, self._rng
        if hp != self._group:
            self._group = hp
            self._period = math.exp(rng.gauss(0.0, noise.period_sigma))
        rate = self.landscape.throughput[hp] * self._period
        rate *= math.exp(rng.gauss(0.0, noise.window_sigma))
        draw = rng.random()
        if draw < noise.stall_rate:
            rate /= rng.uniform(*noise.stall_slowdown)
        elif draw < noise.stall_rate + noise.lucky_rate:
            rate *= noise.lucky_speedup
        # Windows end at sync points, a whole number of iterations apart.
        iterations = max(1, round(self.landscape.throughput[hp] * noise.window_seconds))
        seconds = iterations / rate
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
