"""Run tuners on landscapes over many seeds and summarise how fast each finds a good group.

For every (tuner, landscape, seed) the tuner gets the same budget and the same noise model;
what counts is the *true* throughput of the group it would keep after k samples, as a fraction
of the oracle. Reported per tuner: that fraction after each checkpoint (median and worst over
landscapes x seeds), the number of samples until the kept group is within 2% of the oracle
(median and worst; "never" if not within the budget), and the samples actually used.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from benchmarks.tuner_quality.landscapes import Landscape
from benchmarks.tuner_quality.measurement import NoiseModel
from benchmarks.tuner_quality.tuners import Tuner

#: "Within 2% of the best": the kept group's true throughput is at least this fraction.
GOOD_ENOUGH = 0.98


@dataclass(frozen=True)
class Run:
    """One tuner on one landscape with one seed."""

    tuner: str
    landscape: str
    seed: int
    fractions: tuple[float, ...]
    samples_used: int

    def samples_to_good(self) -> float:
        """Samples until the kept group is within 2% of the oracle (inf: never)."""
        for k, fraction in enumerate(self.fractions, start=1):
            if fraction >= GOOD_ENOUGH:
                return k
        return math.inf


def _run(task: tuple[Tuner, Landscape, int, NoiseModel, int]) -> Run:
    tuner, landscape, budget, noise, seed = task
    trajectory = tuner.run(landscape, budget, noise, seed)
    fractions = tuple(landscape.fraction(hp) for hp in trajectory.choices)
    return Run(tuner.name, landscape.name, seed, fractions, trajectory.samples_used)


def compare(
    tuners: Sequence[Tuner],
    landscapes: Sequence[Landscape],
    seeds: int,
    budget: int,
    noise: NoiseModel,
    jobs: int = 1,
) -> list[Run]:
    """Every tuner on every landscape with seeds ``0..seeds-1`` (the same seeds for all)."""
    tasks = [
        (t, ls, budget, noise, seed) for t in tuners for ls in landscapes for seed in range(seeds)
    ]
    if jobs <= 1:
        return [_run(task) for task in tasks]
    with ProcessPoolExecutor(jobs) as pool:
        return list(pool.map(_run, tasks, chunksize=4))


def _fmt_samples(value: float) -> str:
    return "never" if math.isinf(value) else f"{value:g}"


def _median(values: list[float]) -> float:
    # The lower median of an even count, so the figure is one that actually occurred.
    return sorted(values)[(len(values) - 1) // 2]


def summary_table(runs: Sequence[Run], checkpoints: Sequence[int]) -> str:
    """A markdown table: per tuner, fraction of the oracle at each checkpoint (median / worst),
    samples to within 2% (median / worst), samples used (median), over all runs."""
    tuners = list(dict.fromkeys(run.tuner for run in runs))
    header = ["tuner"]
    header += [f"after {k}: median / worst" for k in checkpoints]
    header += ["samples to 98%: median / worst", "samples used: median", "runs"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for tuner in tuners:
        mine = [run for run in runs if run.tuner == tuner]
        cells = [tuner]
        for k in checkpoints:
            at_k = [run.fractions[min(k, len(run.fractions)) - 1] for run in mine]
            cells.append(f"{_median(at_k):.3f} / {min(at_k):.3f}")
        reach = [run.samples_to_good() for run in mine]
        cells.append(f"{_fmt_samples(_median(reach))} / {_fmt_samples(max(reach))}")
        cells.append(f"{statistics.median(run.samples_used for run in mine):g}")
        cells.append(str(len(mine)))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def per_landscape_table(runs: Sequence[Run]) -> str:
    """A markdown table: samples to within 2% (median / worst) per tuner and landscape, and the
    final fraction of the oracle (worst)."""
    tuners = list(dict.fromkeys(run.tuner for run in runs))
    landscapes = list(dict.fromkeys(run.landscape for run in runs))
    header = ["landscape", *(f"{t}: to 98% med / worst; final worst" for t in tuners)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name in landscapes:
        cells = [name]
        for tuner in tuners:
            mine = [r for r in runs if r.tuner == tuner and r.landscape == name]
            reach = [r.samples_to_good() for r in mine]
            final = min(r.fractions[-1] for r in mine)
            cells.append(
                f"{_fmt_samples(_median(reach))} / {_fmt_samples(max(reach))}; {final:.3f}"
            )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
