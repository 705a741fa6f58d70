"""Tuners under comparison, each run on a landscape with a budget of samples.

A tuner returns a :class:`Trajectory`: the group it would settle on if stopped after each
sample. A tuner whose searching depends on its budget (``budget_aware``: distune plans its last
samples as confirmations, a grid spreads its points over the budget, the Horovod-style tuner
splits the budget between the boolean's values) is run once per budget and judged by its final
choice; the others are run once with the largest budget, and their choice after ``k`` samples is
read off the trajectory.

Every tuner measures groups the same way (:meth:`SimulatedJob.measure`: the first window after a
switch discarded, then at least the sampling time and three windows), so they differ only in
what they measure next and in what they keep:

- ``distune``: the tuning service's own session, as shipped, driven window by window;
- ``random``: the default group, then groups in random order; keeps the best trimmed mean;
- ``grid``: ``budget`` groups spread evenly over the space; keeps the best trimmed mean;
- ``bagua``: Bagua's autotuner (``bagua/service/autotune_task_manager.py``): scikit-optimize's
  ``Optimizer`` with its defaults (a GP, ``gp_hedge`` acquisition) and 20 Halton initial points
  over (bucket_size_2p, is_hierarchical_reduce as 0/1); the job starts on the default group; the
  optimizer is told the last report window of each sample; keeps the group of the single
  highest report window ever seen;
- ``oracle``: not a tuner but a bound on what an honest one can prove: told the best group, it
  measures the default's first sample (left out of the gain, as distune leaves it out), then
  spends every sample on a close call of the best group against the default in legs (as
  distune's close calls), and after each sample keeps the best group only if a paired t
  interval at ``gain_confidence`` on the legs' log trimmed means lies above zero. Its choice
  after ``k`` samples is what a job of budget ``k`` could have proven with no search at all;
- ``horovod``: Horovod's autotuner (``horovod/common/parameter_manager.cc``): a Gaussian process
  with expected improvement over the bucket size, started from fixed seed points (Horovod's 4,
  32, 16, 8 MiB fusion thresholds), one full search per value of the boolean (flat first), the
  budget split between them; a sample's score is the median of its windows; keeps the group of
  the single highest sample score.
"""

from __future__ import annotations

import math
import random
import statistics
import warnings
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import numpy as np
from scipy.stats import t as student_t
from skopt import Optimizer
from skopt.acquisition import gaussian_ei
from skopt.space import Integer, Real
from skopt.utils import cook_estimator

from benchmarks.tuner_quality.landscapes import Landscape
from benchmarks.tuner_quality.measurement import LaggedAnswers, NoiseModel, SimulatedJob
from distune.space import Hyperparameters, SearchSpace
from distune.tuning_service.config import TuningConfig
from distune.tuning_service.messages import Report
from distune.tuning_service.score import robust_throughput
from distune.tuning_service.session import StaleGroupError, State, TuningSession

#: Horovod's seed points for the fusion threshold (parameter_manager.cc), as log2 bytes.
HOROVOD_SEED_2P = (22, 25, 24, 23)  # 4, 32, 16, 8 MiB
#: Bagua's initial design: 20 Halton points (autotune_task_manager.py).
BAGUA_INITIAL_POINTS = 20


@dataclass(frozen=True)
class Trajectory:
    """``choices[k]``: the group the tuner would keep after ``k + 1`` samples (``budget`` of
    them; a tuner that stops early repeats its final choice). ``samples_used``: how many it
    actually measured. ``claimed_gain``: the gain over the default group the tuner reports for
    its final choice (distune's ``gain_vs_default``); None for a tuner that reports none."""

    choices: tuple[Hyperparameters, ...]
    samples_used: int
    claimed_gain: float | None = None
    #: ``(iterations, seconds)`` the job ran from the first sample up to the end of each
    #: sample (a tuner that stops early repeats its totals at completion).
    progress: tuple[tuple[int, float], ...] = ()
    #: The half-width of the claimed gain's confidence interval (distune's), if any.
    claimed_margin: float | None = None


class Tuner(Protocol):
    """What the comparison runs."""

    name: str
    #: True: the search depends on the budget, so the comparison runs it once per budget.
    budget_aware: bool

    def run(self, landscape: Landscape, budget: int, noise: NoiseModel, seed: int) -> Trajectory:
        """Tune ``landscape`` with at most ``budget`` samples."""
        ...


@dataclass(frozen=True)
class DistuneTuner:
    """The tuning service's own session, as shipped (or with ``config`` changed), driven by a
    simulated job's report windows exactly as the leader rank would send them."""

    name: str = "distune"
    config: TuningConfig = field(default_factory=TuningConfig)
    budget_aware: ClassVar[bool] = True

    def run(self, landscape: Landscape, budget: int, noise: NoiseModel, seed: int) -> Trajectory:
        config = TuningConfig(**{**vars(self.config), "max_samples": budget, "seed": seed})
        session = TuningSession("model", landscape.facts, config.fixed, config)
        job = SimulatedJob(landscape, noise, seed)
        choices: list[Hyperparameters] = []
        progress: list[tuple[int, float]] = []
        start = (0, 0.0)  # the job's counters when warmup ends: tuning's cost starts there
        # The leader runs the answers it has at each sync point, which lag the reports.
        answers = LaggedAnswers(session.view.current, noise.answer_seconds)
        while session.view.state is not State.COMPLETED:
            group = answers.latest(job.seconds)
            warming = session.view.state is State.WARMUP
            iterations, seconds = job.window(group.hyperparameters)
            report = Report(group.id, job.train_iter, iterations, seconds)
            spent = session.view.samples
            try:
                reply, _ = session.report(report)
            except StaleGroupError as stale:  # a window of the group before a switch
                reply = stale.reply
            answers.post(job.seconds, reply.group)
            if warming:
                start = (job.train_iter, job.seconds)
            # A budget sample finished (a close call's legs make one sample of the budget).
            if session.view.samples > spent:
                choices.append(session.view.best.group.hyperparameters)
                progress.append((job.train_iter - start[0], job.seconds - start[1]))
        used = len(choices)
        best = session.view.best
        choices += [best.group.hyperparameters] * (budget - used)
        progress += [progress[-1]] * (budget - used)
        return Trajectory(
            tuple(choices), used, best.gain_vs_default, tuple(progress), best.gain_margin
        )


class _PooledScores:
    """Every window of every measured group; the best group by trimmed mean (distune's score)."""

    def __init__(self) -> None:
        self.rates: dict[Hyperparameters, list[float]] = {}

    def add(self, hp: Hyperparameters, rates: list[float]) -> None:
        self.rates.setdefault(hp, []).extend(rates)

    def best(self) -> Hyperparameters:
        return max(self.rates, key=lambda hp: robust_throughput(self.rates[hp]))


def _measure_in_order(
    order: list[Hyperparameters],
    landscape: Landscape,
    noise: NoiseModel,
    seed: int,
    config: TuningConfig,
) -> Trajectory:
    job = SimulatedJob(landscape, noise, seed)
    scores = _PooledScores()
    choices = []
    progress = []
    for hp in order:
        scores.add(hp, job.measure(hp, config.sampling_confidence_time, config.min_windows))
        choices.append(scores.best())
        progress.append((job.train_iter, job.seconds))
    return Trajectory(tuple(choices), len(order), progress=tuple(progress))


@dataclass(frozen=True)
class RandomSearch:
    """The default group first (as distune), then groups in random order without repeats;
    keeps the group with the best robust score."""

    name: str = "random"
    config: TuningConfig = field(default_factory=TuningConfig)
    budget_aware: ClassVar[bool] = False

    def run(self, landscape: Landscape, budget: int, noise: NoiseModel, seed: int) -> Trajectory:
        rng = random.Random(seed)
        space = landscape.space
        others = [hp for hp in space if hp != space.default]
        rng.shuffle(others)
        # A budget above the space's size measures groups again, pooling their windows.
        order = ([space.default, *others] * budget)[:budget]
        return _measure_in_order(order, landscape, noise, seed, self.config)


def grid(space: SearchSpace, points: int) -> list[Hyperparameters]:
    """``points`` groups spread evenly over ``space``: the budget shared between the allreduce
    shapes, and within each, bucket sizes evenly spaced in log2 from the smallest to the largest.
    With ``points`` at least the space's size, every group (then again, in the same order)."""
    groups = list(space)
    if points >= len(groups):
        return (groups * math.ceil(points / len(groups)))[:points]
    shapes = space.hierarchical_choices
    low, high = space.min_bucket_size_2p, space.max_bucket_size_2p
    chosen: list[Hyperparameters] = []
    for index, shape in enumerate(shapes):
        share = points // len(shapes) + (index < points % len(shapes))
        if share == 0:
            continue
        exponents = np.linspace(low, high, share) if share > 1 else [(low + high) / 2]
        for exponent in dict.fromkeys(round(float(e)) for e in exponents):
            chosen.append(Hyperparameters(exponent, shape))
    # Rounding can merge two points of a short range: fill up with unmeasured groups.
    rest = [hp for hp in groups if hp not in chosen]
    return chosen + rest[: points - len(chosen)]


@dataclass(frozen=True)
class GridSearch:
    """``budget`` groups evenly spread over the space (:func:`grid`); keeps the group with the
    best robust score."""

    name: str = "grid"
    config: TuningConfig = field(default_factory=TuningConfig)
    budget_aware: ClassVar[bool] = True

    def run(self, landscape: Landscape, budget: int, noise: NoiseModel, seed: int) -> Trajectory:
        order = grid(landscape.space, budget)
        return _measure_in_order(order, landscape, noise, seed, self.config)


@dataclass(frozen=True)
class BaguaStyle:
    """Bagua's autotuner (see the module's docstring)."""

    name: str = "bagua"
    config: TuningConfig = field(default_factory=TuningConfig)
    #: Random points the acquisition is maximised over: the spaces hold at most a few dozen
    #: groups, so a few hundred draws cover every one.
    acquisition_points: int = 1000
    budget_aware: ClassVar[bool] = False

    def run(self, landscape: Landscape, budget: int, noise: NoiseModel, seed: int) -> Trajectory:
        space = landscape.space
        dimensions: list[Integer] = [
            Integer(space.min_bucket_size_2p, space.max_bucket_size_2p, name="bucket_size_2p")
        ]
        if len(space.hierarchical_choices) > 1:
            dimensions.append(Integer(0, 1, name="is_hierarchical_reduce"))
        optimizer = Optimizer(
            dimensions,
            n_initial_points=BAGUA_INITIAL_POINTS,
            initial_point_generator="halton",
            # The acquisition is maximised over 1,000 random points rather than by L-BFGS from
            # them (skopt's default): these spaces hold at most a few dozen groups, so the draws
            # cover every one and the maximum is the same or better, several times faster.
            acq_optimizer="sampling",
            acq_optimizer_kwargs={"n_points": self.acquisition_points},
            random_state=seed,
        )
        job = SimulatedJob(landscape, noise, seed)
        best_rate, best = -math.inf, space.default
        choices = []
        progress = []
        hp = space.default  # the job registers and starts on the default group
        for _ in range(budget):
            rates = job.measure(hp, self.config.sampling_confidence_time, self.config.min_windows)
            top = max(rates)
            if top > best_rate:  # the single highest report
                best_rate, best = top, hp
            choices.append(best)
            progress.append((job.train_iter, job.seconds))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # duplicate proposals, GP convergence
                optimizer.tell(_bagua_point(space, hp), -rates[-1])  # the last report window
                hp = _bagua_group(space, optimizer.ask())
        return Trajectory(tuple(choices), budget, progress=tuple(progress))


@dataclass(frozen=True)
class HorovodStyle:
    """Horovod's autotuner (see the module's docstring)."""

    name: str = "horovod"
    config: TuningConfig = field(default_factory=TuningConfig)
    xi: float = 0.01
    budget_aware: ClassVar[bool] = True

    def run(self, landscape: Landscape, budget: int, noise: NoiseModel, seed: int) -> Trajectory:
        space = landscape.space
        shapes = space.hierarchical_choices
        low, high = space.min_bucket_size_2p, space.max_bucket_size_2p
        seeds = list(dict.fromkeys(min(max(e, low), high) for e in HOROVOD_SEED_2P))
        exponents = np.arange(low, high + 1)
        candidates = ((exponents - low) / max(1, high - low)).reshape(-1, 1)
        job = SimulatedJob(landscape, noise, seed)
        rng = np.random.default_rng(seed)
        best_score, best = -math.inf, space.default
        choices = []
        progress = []
        for index, shape in enumerate(shapes):
            share = budget // len(shapes) + (index < budget % len(shapes))
            told_x: list[float] = []
            told_y: list[float] = []
            for step in range(share):
                if step < len(seeds):
                    exponent = seeds[step]
                else:
                    exponent = int(exponents[self._propose(candidates, told_x, told_y, rng)])
                hp = Hyperparameters(exponent, shape)
                rates = job.measure(
                    hp, self.config.sampling_confidence_time, self.config.min_windows
                )
                score = statistics.median(rates)
                if score > best_score:  # the single highest score
                    best_score, best = score, hp
                choices.append(best)
                progress.append((job.train_iter, job.seconds))
                told_x.append((exponent - low) / max(1, high - low))
                told_y.append(score)
        return Trajectory(tuple(choices), budget, progress=tuple(progress))

    def _propose(
        self, candidates: np.ndarray, xs: list[float], ys: list[float], rng: np.random.Generator
    ) -> int:
        """The candidate of largest expected improvement (repeats allowed, as Horovod's
        continuous search allows them)."""
        model = cook_estimator(
            "GP",
            space=[Real(0.0, 1.0)],
            noise="gaussian",
            n_restarts_optimizer=0,
            random_state=int(rng.integers(2**31 - 1)),
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.fit(np.array(xs).reshape(-1, 1), -np.array(ys))
            y_opt = float(np.min(model.predict(np.array(xs).reshape(-1, 1))))
            values = gaussian_ei(candidates, model, y_opt=y_opt, xi=self.xi)
        return int(np.argmax(values))


@dataclass(frozen=True)
class ProvingOracle:
    """The most an honest session could prove (see the module's docstring): the best group
    known, every sample after the default's first a close call of it against the default."""

    name: str = "oracle"
    config: TuningConfig = field(default_factory=TuningConfig)
    budget_aware: ClassVar[bool] = False

    def run(self, landscape: Landscape, budget: int, noise: NoiseModel, seed: int) -> Trajectory:
        config = self.config
        throughput = landscape.throughput
        best, default = max(throughput, key=throughput.__getitem__), landscape.space.default
        legs = max(1, math.floor(config.close_call_time))
        share = config.close_call_time / legs  # a leg's sampling time and windows, as distune's
        leg_seconds = config.sampling_confidence_time * share
        leg_windows = math.ceil(config.min_windows * share)
        job = SimulatedJob(landscape, noise, seed)
        job.measure(default, config.sampling_confidence_time, config.min_windows)
        choices, progress = [default], [(job.train_iter, job.seconds)]
        differences: list[float] = []
        claim: tuple[float, float] | None = None
        for _ in range(budget - 1):
            if best == default:
                choices.append(default)  # nothing to prove: the default is the best
                progress.append(progress[-1])
                continue
            for _ in range(max(1, legs // 2)):
                legs_rates = [job.measure(hp, leg_seconds, leg_windows) for hp in (best, default)]
                logs = [math.log(robust_throughput(rates)) for rates in legs_rates]
                differences.append(logs[0] - logs[1])
            claim = _paired_claim(differences, config.gain_confidence)
            choices.append(best if claim is not None and claim[0] > claim[1] else default)
            progress.append((job.train_iter, job.seconds))
        gain, margin = 0.0, None
        if claim is not None and choices[-1] == best != default:
            mean, half = claim  # in log throughput; as a gain, like distune's claim
            gain, margin = math.expm1(mean), (math.expm1(mean + half) - math.expm1(mean - half)) / 2
        return Trajectory(tuple(choices), budget, gain, tuple(progress), claimed_margin=margin)


def _paired_claim(differences: list[float], confidence: float) -> tuple[float, float] | None:
    """The mean of paired log differences and its ``confidence`` half-width (Student's t), or
    None with fewer than two pairs."""
    if len(differences) < 2:
        return None
    quantile = float(student_t.ppf(0.5 + confidence / 2.0, len(differences) - 1))
    spread = statistics.stdev(differences) / math.sqrt(len(differences))
    return statistics.fmean(differences), quantile * spread


def _bagua_point(space: SearchSpace, hp: Hyperparameters) -> list[int]:
    """Bagua's optimizer point: the bucket exponent, and the boolean as 0/1 where tuned."""
    point = [hp.bucket_size_2p]
    if len(space.hierarchical_choices) > 1:
        point.append(int(hp.is_hierarchical_reduce))
    return point


def _bagua_group(space: SearchSpace, point: list) -> Hyperparameters:
    shape = bool(point[1]) if len(point) > 1 else space.hierarchical_choices[0]
    return Hyperparameters(int(point[0]), shape)
