"""Tuners under comparison, each run on a landscape with a budget of samples.

A tuner returns a :class:`Trajectory`: the group it would settle on if stopped after each
sample. Add a comparison tuner by writing a class with a ``name`` and a ``run`` method; the
baselines measure groups exactly as the service does (:meth:`SimulatedJob.measure`, scored by
the same robust statistic), so they differ from distune only in how they search and choose.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Protocol

from benchmarks.tuner_quality.landscapes import Landscape
from benchmarks.tuner_quality.measurement import NoiseModel, SimulatedJob
from distune.space import Hyperparameters
from distune.tuning_service.config import TuningConfig
from distune.tuning_service.messages import Report
from distune.tuning_service.score import robust_throughput
from distune.tuning_service.session import Phase, State, TuningSession


@dataclass(frozen=True)
class Trajectory:
    """``choices[k]``: the group the tuner would keep after ``k + 1`` samples (``budget`` of
    them; a tuner that stops early repeats its final choice). ``samples_used``: how many it
    actually measured."""

    choices: tuple[Hyperparameters, ...]
    samples_used: int


class Tuner(Protocol):
    """What the comparison runs."""

    name: str

    def run(self, landscape: Landscape, budget: int, noise: NoiseModel, seed: int) -> Trajectory:
        """Tune ``landscape`` with at most ``budget`` samples."""
        ...


@dataclass(frozen=True)
class DistuneTuner:
    """The tuning service's own session, as shipped (or with ``config`` changed), driven by a
    simulated job's report windows exactly as the leader rank would send them."""

    name: str = "distune"
    config: TuningConfig = field(default_factory=TuningConfig)

    def run(self, landscape: Landscape, budget: int, noise: NoiseModel, seed: int) -> Trajectory:
        config = TuningConfig(**{**vars(self.config), "max_samples": budget, "seed": seed})
        session = TuningSession("model", landscape.facts, config.fixed, config)
        job = SimulatedJob(landscape, noise, seed)
        choices: list[Hyperparameters] = []
        while session.view.state is not State.COMPLETED:
            group = session.view.current
            iterations, seconds = job.window(group.hyperparameters)
            _, records = session.report(Report(group.id, job.train_iter, iterations, seconds))
            for record in records:
                if record.phase is not Phase.COMPLETED:
                    choices.append(session.view.best.group.hyperparameters)
        used = len(choices)
        choices += [session.view.best.group.hyperparameters] * (budget - used)
        return Trajectory(tuple(choices), used)


@dataclass(frozen=True)
class RandomSearch:
    """The default group first (as distune), then groups in random order without repeats;
    keeps the group with the best robust score."""

    name: str = "random"
    config: TuningConfig = field(default_factory=TuningConfig)

    def run(self, landscape: Landscape, budget: int, noise: NoiseModel, seed: int) -> Trajectory:
        rng = random.Random(seed)
        job = SimulatedJob(landscape, noise, seed)
        space = landscape.space
        others = [hp for hp in space if hp != space.default]
        rng.shuffle(others)
        # A budget above the space's size measures groups again, pooling their windows.
        order = ([space.default, *others] * budget)[:budget]
        rates: dict[Hyperparameters, list[float]] = {}
        scores: dict[Hyperparameters, float] = {}
        choices = []
        for hp in order:
            config = self.config
            measured = job.measure(hp, config.sampling_confidence_time, config.min_windows)
            rates[hp] = rates.get(hp, []) + measured
            scores[hp] = robust_throughput(rates[hp])
            choices.append(max(scores, key=scores.__getitem__))
        return Trajectory(tuple(choices), budget)
