"""scikit-optimize's Gaussian process against Optuna's samplers, driving the same session.

    # optuna is in the dev extras (pyproject.toml): a dependency of this study, not of distune
    .venv/bin/python -m benchmarks.tuner_quality.sampler_study --draw training --count 40 \
        --seeds 5 --jobs 2 --json samplers.json
    .venv/bin/python -m benchmarks.tuner_quality.sampler_study --timing

The session (``TuningSession``) is the shipped one; only the Bayesian phase of its optimizer
changes. Each engine keeps the session's contract where its public API allows: the same greedy
maximin initial design (``GroupOptimizer``'s), the fixed knobs removed from the space, the
hierarchical knob a category, only unmeasured groups proposed, each group told once with its
pooled score (a fresh study for each suggestion: Optuna, like skopt, cannot replace an
observation). Two parts of the contract Optuna's samplers cannot keep, so the study measures
skopt without them as well, like for like:

- *cost-aware choice*: dividing the acquisition by the predicted cost of a sample needs the
  acquisition's values and the model's predictions; an Optuna sampler returns one point;
- *the early stop*: it reads the largest expected improvement; an Optuna variant stops only
  when its sampler keeps proposing measured groups (``_ASKS`` times in a row).

``--timing`` measures the wall time of one suggestion (a fit and a proposal) for each engine on
the same told scores, side by side in one process.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar
from unittest import mock

import numpy as np
from threadpoolctl import threadpool_limits

from benchmarks.tuner_quality.__main__ import DRAW_NOISE
from benchmarks.tuner_quality.compare import compare, percentile_table, save_runs
from benchmarks.tuner_quality.landscapes import Landscape
from benchmarks.tuner_quality.measurement import NoiseModel
from benchmarks.tuner_quality.random_clusters import DRAW_SEEDS, draw
from benchmarks.tuner_quality.tuners import DistuneTuner, Trajectory
from distune.space import BUCKET_SIZE_2P, IS_HIERARCHICAL_REDUCE, Hyperparameters, SearchSpace
from distune.tuning_service import session as session_module
from distune.tuning_service.config import OptimizerSettings, TuningConfig
from distune.tuning_service.optimizer import GroupOptimizer, Suggestion

#: Proposals asked of an Optuna sampler before it is taken to see nothing left to measure.
_ASKS = 8
ENGINES = ("skopt-gp", "optuna-tpe", "optuna-gp")


class OptunaGroupOptimizer(GroupOptimizer):
    """``GroupOptimizer`` whose Bayesian phase asks an Optuna sampler (``tpe`` or ``gp``)."""

    def __init__(
        self, space: SearchSpace, settings: OptimizerSettings, seed: int | None, engine: str
    ) -> None:
        super().__init__(space, settings, seed)
        self._engine = engine

    def suggest(self, cost: Callable[[np.ndarray], np.ndarray] | None = None) -> Suggestion | None:
        low, high = self._prior_sizes
        allowed = {
            hp for hp in self._groups if hp not in self._scores and low <= hp.bucket_size_2p <= high
        }
        if len(self._scores) < self._settings.initial_points or not allowed:
            return super().suggest(cost)
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        distributions = _distributions(self._space)
        study = optuna.create_study(direction="maximize", sampler=self._sampler())
        for hp, score in self._scores.items():
            study.add_trial(
                optuna.trial.create_trial(
                    params=_params(self._space, hp),
                    distributions=distributions,
                    value=math.log(score),
                )
            )
        for _ in range(_ASKS):
            trial = study.ask(distributions)
            hp = self._space.complete([trial.params[name] for name in self._space.tuned])
            if hp in allowed:
                return Suggestion(hp, math.inf)
            # A measured group is told its score again; one beyond the prior is not measured.
            value = self._scores.get(hp)
            study.tell(trial, None if value is None else math.log(value), state=_state(value))
        unmeasured = [i for i, hp in enumerate(self._groups) if hp in allowed]
        return Suggestion(self._next_initial(unmeasured), 0.0)

    def _sampler(self) -> Any:
        import optuna

        seed = self._draw_seed()
        if self._engine == "optuna-tpe":
            return optuna.samplers.TPESampler(seed=seed, n_startup_trials=0, multivariate=True)
        return optuna.samplers.GPSampler(seed=seed, n_startup_trials=0)


def _state(value: float | None) -> Any:
    import optuna

    return optuna.trial.TrialState.COMPLETE if value is not None else optuna.trial.TrialState.FAIL


def _distributions(space: SearchSpace) -> dict[str, Any]:
    """Optuna's distributions of the tuned knobs over the whole space."""
    import optuna

    distributions: dict[str, Any] = {}
    for name in space.tuned:
        if name == BUCKET_SIZE_2P:
            low, high = space.min_bucket_size_2p, space.max_bucket_size_2p
            distributions[name] = optuna.distributions.IntDistribution(low, high)
        elif name == IS_HIERARCHICAL_REDUCE:
            choices = list(space.hierarchical_choices)
            distributions[name] = optuna.distributions.CategoricalDistribution(choices)
    return distributions


def _params(space: SearchSpace, hp: Hyperparameters) -> dict[str, Any]:
    return dict(zip(space.tuned, space.point(hp), strict=True))


@contextmanager
def _engine(engine: str) -> Iterator[None]:
    if engine == "skopt-gp":
        yield
        return

    def make(space: SearchSpace, settings: OptimizerSettings, seed: int | None) -> GroupOptimizer:
        return OptunaGroupOptimizer(space, settings, seed, engine)

    with mock.patch.object(session_module, "GroupOptimizer", make):
        yield


@dataclass(frozen=True)
class EngineTuner(DistuneTuner):
    """The shipped session with its Bayesian phase run by ``engine``."""

    engine: str = "skopt-gp"
    budget_aware: ClassVar[bool] = True

    def run(self, landscape: Landscape, budget: int, noise: NoiseModel, seed: int) -> Trajectory:
        with _engine(self.engine):
            return super().run(landscape, budget, noise, seed)


def tuners() -> list[EngineTuner]:
    """Each engine with the shipped settings, and each without cost-aware choice (what an
    Optuna sampler cannot do), named ``<engine>`` and ``<engine> no cost``."""
    shipped = TuningConfig()
    no_cost = dataclasses.replace(
        shipped, optimizer=dataclasses.replace(shipped.optimizer, cost_aware=False)
    )
    found = [EngineTuner("skopt-gp", shipped, engine="skopt-gp")]
    for engine in ENGINES:
        found.append(EngineTuner(f"{engine} no cost", no_cost, engine=engine))
    return found


def timing(repeats: int) -> str:
    """Milliseconds per suggestion of each engine (CPU time, which the machine's load does not
    inflate, and wall time), told the true throughput of 6 and 12 groups of three held-out
    landscapes, side by side, with one BLAS thread."""
    landscapes = draw(DRAW_SEEDS["held-out"], 3)
    rows = [
        "| engine | groups told | CPU ms per suggestion: median | max | wall ms: median |",
        "|---|---|---|---|---|",
    ]
    for told in (6, 12):
        for engine in ENGINES:
            times, walls = [], []
            for landscape in landscapes:
                for seed in range(repeats):
                    optimizer = _optimizer(engine, landscape.space, seed)
                    rng = np.random.default_rng(seed)
                    groups = list(landscape.space)
                    for index in rng.permutation(len(groups))[:told]:
                        optimizer.tell(groups[index], landscape.throughput[groups[index]])
                    cpu, wall = time.process_time(), time.perf_counter()
                    with threadpool_limits(1):
                        optimizer.suggest()
                    times.append(1000 * (time.process_time() - cpu))
                    walls.append(1000 * (time.perf_counter() - wall))
            rows.append(
                f"| {engine} | {told} | {statistics.median(times):.0f} | {max(times):.0f} "
                f"| {statistics.median(walls):.0f} |"
            )
    return "\n".join(rows)


def _optimizer(engine: str, space: SearchSpace, seed: int) -> GroupOptimizer:
    settings = OptimizerSettings(initial_points=1)
    if engine == "skopt-gp":
        return GroupOptimizer(space, settings, seed)
    return OptunaGroupOptimizer(space, settings, seed, engine)


def main(argv: list[str] | None = None) -> int:
    """Run the study; print the percentile table (and write JSON with --json)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tuner_quality.sampler_study")
    parser.add_argument("--draw", choices=tuple(DRAW_SEEDS), default="training")
    parser.add_argument("--count", type=int, default=40)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--budgets", default="5,8,12,20,40")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--only", help="comma-separated tuner names")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--timing", action="store_true", help="time one suggestion instead")
    parser.add_argument("--repeats", type=int, default=5, help="with --timing: seeds per case")
    args = parser.parse_args(argv)
    if args.timing:
        print(timing(args.repeats))
        return 0
    chosen = [t for t in tuners() if not args.only or t.name in args.only.split(",")]
    budgets = [int(b) for b in args.budgets.split(",")]
    started = time.perf_counter()
    runs = compare(
        chosen,
        draw(DRAW_SEEDS[args.draw], args.count),
        args.seeds,
        budgets,
        DRAW_NOISE,
        args.jobs,
        args.first_seed,
    )
    print(f"# {args.draw} draw, {args.count} landscapes x {args.seeds} seeds")
    print(f"{time.perf_counter() - started:.0f} s with {args.jobs} job(s)\n")
    print(percentile_table(runs, budgets))
    if args.json:
        save_runs(runs, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
