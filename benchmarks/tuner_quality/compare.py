"""Run tuners on landscapes over many seeds and summarise how good a group each one keeps.

For every (tuner, landscape, seed) and every budget of samples, the tuner tunes under the same
noise model; what counts is the *true* throughput of the group it finally keeps, as a fraction
of the oracle's (the best group's). Per tuner and budget: the median run and the worst run over
landscapes x seeds; and the smallest budget from which the median (or the worst) run stays
within 2% of the oracle.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from threadpoolctl import threadpool_limits

from benchmarks.tuner_quality.landscapes import Landscape
from benchmarks.tuner_quality.measurement import NoiseModel
from benchmarks.tuner_quality.tuners import Trajectory, Tuner

#: "Within 2% of the best": the kept group's true throughput is at least this fraction.
GOOD_ENOUGH = 0.98


@dataclass(frozen=True)
class Run:
    """One tuner on one landscape with one seed: for each budget, the true fraction of the
    oracle of the group it keeps, how many samples it measured and, for a tuner that reports
    its gain over the default group, how far that claim is off: the claimed speedup over the
    true one, minus 1 (+0.10: it claims 10% more than it gained; None: no claim, or it kept
    the default group, whose gain is 0 by definition)."""

    tuner: str
    landscape: str
    seed: int
    budgets: tuple[int, ...]
    fractions: tuple[float, ...]
    samples_used: tuple[int, ...]
    gain_errors: tuple[float | None, ...]
    #: Throughput while tuning: iterations done until completion over what the best group
    #: would have done in the same time.
    tuning_fractions: tuple[float, ...] = ()
    #: Whether the claimed gain's confidence interval holds the true gain (None: no claim).
    gain_covered: tuple[bool | None, ...] = ()
    #: Job seconds from the end of warmup until tuning completed (runs saved before this
    #: field was added have none).
    tuning_seconds: tuple[float, ...] = ()

    def fraction_at(self, budget: int) -> float:
        """The kept group's fraction of the oracle with ``budget`` samples."""
        return self.fractions[self.budgets.index(budget)]

    def tuning_fraction_at(self, budget: int) -> float:
        """The throughput while tuning with ``budget`` samples, as a fraction of the best's."""
        return self.tuning_fractions[self.budgets.index(budget)]

    def gain_error_at(self, budget: int) -> float | None:
        """How far the claimed gain is off with ``budget`` samples (see the class)."""
        return self.gain_errors[self.budgets.index(budget)]


def _gain_error(landscape: Landscape, trajectory: Trajectory) -> float | None:
    chosen = trajectory.choices[-1]
    default = landscape.space.default
    if trajectory.claimed_gain is None or chosen == default:
        return None
    true_speedup = landscape.throughput[chosen] / landscape.throughput[default]
    return (1.0 + trajectory.claimed_gain) / true_speedup - 1.0


def _gain_covered(landscape: Landscape, trajectory: Trajectory) -> bool | None:
    """Whether the claimed gain's interval holds the true gain of the kept group."""
    if trajectory.claimed_gain is None or trajectory.claimed_margin is None:
        return None
    default = landscape.space.default
    true_gain = landscape.throughput[trajectory.choices[-1]] / landscape.throughput[default] - 1
    return abs(trajectory.claimed_gain - true_gain) <= trajectory.claimed_margin


def _tuning_fraction(landscape: Landscape, trajectory: Trajectory, budget: int) -> float:
    iterations, seconds = trajectory.progress[budget - 1]
    return iterations / (seconds * landscape.oracle)


def _run(task: tuple[Tuner, Landscape, tuple[int, ...], NoiseModel, int]) -> Run:
    tuner, landscape, budgets, noise, seed = task
    fractions, used, gain_errors, tuning, covered, seconds = [], [], [], [], [], []
    if tuner.budget_aware:
        for budget in budgets:
            trajectory = tuner.run(landscape, budget, noise, seed)
            fractions.append(landscape.fraction(trajectory.choices[-1]))
            used.append(trajectory.samples_used)
            gain_errors.append(_gain_error(landscape, trajectory))
            tuning.append(_tuning_fraction(landscape, trajectory, budget))
            covered.append(_gain_covered(landscape, trajectory))
            seconds.append(trajectory.progress[budget - 1][1])
    else:  # one run with the largest budget; its choice after k samples is the k-budget one
        trajectory = tuner.run(landscape, max(budgets), noise, seed)
        for budget in budgets:
            fractions.append(landscape.fraction(trajectory.choices[budget - 1]))
            used.append(min(budget, trajectory.samples_used))
            gain_errors.append(None)  # no tuner of this kind reports a gain
            tuning.append(_tuning_fraction(landscape, trajectory, budget))
            covered.append(None)
            seconds.append(trajectory.progress[budget - 1][1])
    return Run(
        tuner.name,
        landscape.name,
        seed,
        budgets,
        tuple(fractions),
        tuple(used),
        tuple(gain_errors),
        tuple(tuning),
        tuple(covered),
        tuple(seconds),
    )


def compare(
    tuners: Sequence[Tuner],
    landscapes: Sequence[Landscape],
    seeds: int,
    budgets: Sequence[int],
    noise: NoiseModel,
    jobs: int = 1,
    first_seed: int = 0,
) -> list[Run]:
    """Every tuner on every landscape with seeds ``first_seed..first_seed+seeds-1`` (the same
    seeds, so the same noise draws where two tuners measure alike) at every budget."""
    ordered = tuple(sorted(set(budgets)))
    seed_range = range(first_seed, first_seed + seeds)
    tasks = [
        (t, ls, ordered, noise, seed) for t in tuners for ls in landscapes for seed in seed_range
    ]
    if jobs <= 1:
        with threadpool_limits(1):
            return [_run(task) for task in tasks]
    with ProcessPoolExecutor(jobs, initializer=_one_thread) as pool:
        return list(pool.map(_run, tasks, chunksize=2))


def _one_thread() -> None:
    # The Gaussian-process fits are tiny: BLAS threads only contend for the cores (three times
    # slower on two cores), and the pool already uses them.
    threadpool_limits(1)


def _median(values: Sequence[float]) -> float:
    # The lower median of an even count, so the figure is one that actually occurred.
    return sorted(values)[(len(values) - 1) // 2]


def curve(runs: Sequence[Run], tuner: str, statistic: str) -> dict[int, float]:
    """The median (``statistic="median"``) or worst (``"worst"``) run's fraction of the oracle
    per budget, over all of ``tuner``'s runs."""
    mine = [run for run in runs if run.tuner == tuner]
    reduce = _median if statistic == "median" else min
    return {b: reduce([run.fraction_at(b) for run in mine]) for b in mine[0].budgets}


def budget_to_good(points: dict[int, float]) -> float:
    """The smallest budget from which ``points`` stays at or above 98% (inf: never)."""
    reached = math.inf
    for budget in sorted(points, reverse=True):
        if points[budget] < GOOD_ENOUGH:
            break
        reached = budget
    return reached


def _markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """``header`` and ``rows`` as a markdown table, one line each."""
    lines = ["| " + " | ".join(cells) + " |" for cells in (header, *rows)]
    lines.insert(1, "|" + "---|" * len(header))
    return "\n".join(lines)


def _fmt_budget(value: float) -> str:
    return "never" if math.isinf(value) else f"{value:g}"


def summary_table(runs: Sequence[Run], checkpoints: Sequence[int]) -> str:
    """A markdown table: per tuner, fraction of the oracle after each checkpoint (median /
    worst), the budget from which median and worst stay within 2%, and samples used with the
    largest budget (median)."""
    tuners = list(dict.fromkeys(run.tuner for run in runs))
    header = ["tuner", *(f"after {k}: median / worst" for k in checkpoints)]
    header += [
        "samples to 98%: median / worst",
        f"samples used (budget {max(runs[0].budgets)}): median",
    ]
    rows: list[list[str]] = []
    for tuner in tuners:
        median, worst = curve(runs, tuner, "median"), curve(runs, tuner, "worst")
        cells = [tuner, *(f"{median[k]:.3f} / {worst[k]:.3f}" for k in checkpoints)]
        cells.append(
            f"{_fmt_budget(budget_to_good(median))} / {_fmt_budget(budget_to_good(worst))}"
        )
        used = [run.samples_used[-1] for run in runs if run.tuner == tuner]
        cells.append(f"{statistics.median(used):g}")
        rows.append(cells)
    return _markdown_table(header, rows)


def gain_claim_table(runs: Sequence[Run], checkpoints: Sequence[int]) -> str:
    """A markdown table: per tuner that reports its gain over the default group, how far the
    claim is off after each checkpoint (median / largest overstatement, in percent of the true
    speedup), over the runs that kept a group other than the default; empty if none reports."""
    tuners = list(dict.fromkeys(r.tuner for r in runs if any(e is not None for e in r.gain_errors)))
    if not tuners:
        return ""
    header = ["tuner", *(f"after {k}: median / largest (runs)" for k in checkpoints)]
    rows: list[list[str]] = []
    for tuner in tuners:
        cells = [tuner]
        for k in checkpoints:
            errors = [r.gain_error_at(k) for r in runs if r.tuner == tuner]
            errors = [e for e in errors if e is not None]
            cells.append(
                f"{_median(errors):+.1%} / {max(errors):+.1%} ({len(errors)})" if errors else "-"
            )
        rows.append(cells)
    return _markdown_table(header, rows)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile of ``values`` as one of them (the lower one between two), so
    the figure is one that actually occurred."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def percentile_table(runs: Sequence[Run], checkpoints: Sequence[int]) -> str:
    """A markdown table: per tuner and budget, the final choice's fraction of the best group
    (1st, 5th percentile and median over landscapes x seeds) and the throughput while tuning
    (mean, and its 5th percentile)."""
    tuners = list(dict.fromkeys(run.tuner for run in runs))
    header = [
        "tuner",
        "budget",
        "final choice: 1st pct",
        "5th pct",
        "median",
        "while tuning: mean",
        "5th pct",
    ]
    rows: list[list[str]] = []
    for tuner in tuners:
        mine = [run for run in runs if run.tuner == tuner]
        for k in checkpoints:
            final = [run.fraction_at(k) for run in mine]
            tuning = [run.tuning_fraction_at(k) for run in mine]
            cells = [
                tuner,
                str(k),
                f"{percentile(final, 1):.3f}",
                f"{percentile(final, 5):.3f}",
                f"{percentile(final, 50):.3f}",
                f"{statistics.fmean(tuning):.3f}",
                f"{percentile(tuning, 5):.3f}",
            ]
            rows.append(cells)
    return _markdown_table(header, rows)


#: The issue's bars for the final choice: the counts below them say more than a percentile
#: that moves by single runs.
SHORTFALL_BARS = (0.97, 0.99)


def shortfall_table(runs: Sequence[Run], checkpoints: Sequence[int]) -> str:
    """A markdown table: per tuner and budget, how many runs kept a group below each of
    :data:`SHORTFALL_BARS` of the best group, of how many runs."""
    tuners = list(dict.fromkeys(run.tuner for run in runs))
    header = ["tuner", *(f"budget {k}" for k in checkpoints)]
    rows: list[list[str]] = []
    for tuner in tuners:
        mine = [run for run in runs if run.tuner == tuner]
        cells = [tuner]
        for k in checkpoints:
            final = [run.fraction_at(k) for run in mine]
            below = " / ".join(str(sum(f < bar for f in final)) for bar in SHORTFALL_BARS)
            cells.append(f"{below} of {len(final)}")
        rows.append(cells)
    return _markdown_table(header, rows)


def coverage_table(runs: Sequence[Run], checkpoints: Sequence[int]) -> str:
    """A markdown table: per tuner that reports an interval on its gain, how often the interval
    holds the true gain of the kept group, per budget; empty if none does."""
    tuners = list(
        dict.fromkeys(r.tuner for r in runs if any(c is not None for c in r.gain_covered))
    )
    if not tuners:
        return ""
    header = ["tuner", *(f"budget {k}" for k in checkpoints)]
    rows: list[list[str]] = []
    for tuner in tuners:
        cells = [tuner]
        for k in checkpoints:
            index = runs[0].budgets.index(k)
            flags = [r.gain_covered[index] for r in runs if r.tuner == tuner]
            flags = [f for f in flags if f is not None]
            cells.append(f"{sum(flags) / len(flags):.1%} of {len(flags)}" if flags else "-")
        rows.append(cells)
    return _markdown_table(header, rows)


def tuning_time_table(
    runs: Sequence[Run], checkpoints: Sequence[int], sample_seconds: float
) -> str:
    """A markdown table: per tuner and budget, the job time tuning took (from the end of
    warmup until completion) over the budget times the sampling time, mean / 95th percentile
    / largest; empty if no run recorded its time."""
    tuners = list(dict.fromkeys(r.tuner for r in runs if r.tuning_seconds))
    if not tuners:
        return ""
    header = ["tuner", *(f"budget {k}: mean / 95th pct / max" for k in checkpoints)]
    rows: list[list[str]] = []
    for tuner in tuners:
        cells = [tuner]
        for k in checkpoints:
            index = runs[0].budgets.index(k)
            ratios = [
                r.tuning_seconds[index] / (k * sample_seconds)
                for r in runs
                if r.tuner == tuner and r.tuning_seconds
            ]
            cells.append(
                f"{statistics.fmean(ratios):.1f} / {percentile(ratios, 95):.1f} / {max(ratios):.1f}"
            )
        rows.append(cells)
    return _markdown_table(header, rows)


def per_landscape_table(runs: Sequence[Run], checkpoints: Sequence[int]) -> str:
    """A markdown table: per landscape and tuner, the worst seed's fraction of the oracle after
    each checkpoint."""
    tuners = list(dict.fromkeys(run.tuner for run in runs))
    landscapes = list(dict.fromkeys(run.landscape for run in runs))
    marks = "/".join(str(k) for k in checkpoints)
    header = ["landscape", *(f"{t}: worst after {marks}" for t in tuners)]
    rows: list[list[str]] = []
    for name in landscapes:
        cells = [name]
        for tuner in tuners:
            mine = [r for r in runs if r.tuner == tuner and r.landscape == name]
            worst = [min(r.fraction_at(k) for r in mine) for k in checkpoints]
            cells.append(" / ".join(f"{w:.2f}" for w in worst))
        rows.append(cells)
    return _markdown_table(header, rows)


def plot(runs: Sequence[Run], path: Path, title: str) -> None:
    """Two panels (median run, worst run): fraction of the oracle against the budget, one line
    per tuner."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    tuners = list(dict.fromkeys(run.tuner for run in runs))
    figure, axes = plt.subplots(1, 2, figsize=(8.0, 3.2), dpi=100)
    for axis, statistic in zip(axes, ("median", "worst"), strict=True):
        for tuner in tuners:
            points = curve(runs, tuner, statistic)
            style = {"linewidth": 2.2, "color": "black"} if tuner == "distune" else {}
            axis.plot(list(points), list(points.values()), marker=".", label=tuner, **style)
        axis.axhline(GOOD_ENOUGH, color="grey", linestyle=":", linewidth=1)
        axis.set_xscale("log")
        budgets = sorted(runs[0].budgets)
        axis.set_xticks(budgets, [str(b) for b in budgets])
        axis.minorticks_off()
        axis.set_xlabel("samples (budget)")
        axis.set_title(f"{statistic} run", fontsize=10)
        axis.grid(alpha=0.3)
    axes[0].set_ylabel("true throughput / oracle")
    axes[0].set_ylim(0.85, 1.005)
    axes[1].legend(fontsize=8, loc="lower right")
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def percentile_plot(runs: Sequence[Run], path: Path, title: str) -> None:
    """Three panels against the budget, one line per tuner: the final choice's 1st percentile
    and median fraction of the best group, and the mean throughput while tuning."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    tuners = list(dict.fromkeys(run.tuner for run in runs))
    budgets = sorted(runs[0].budgets)
    figure, axes = plt.subplots(1, 3, figsize=(11.0, 3.3), dpi=100)
    panels = (
        (
            "final choice: 1st percentile",
            lambda rs, k: percentile([r.fraction_at(k) for r in rs], 1),
        ),
        ("final choice: median", lambda rs, k: percentile([r.fraction_at(k) for r in rs], 50)),
        (
            "throughput while tuning: mean",
            lambda rs, k: statistics.fmean(r.tuning_fraction_at(k) for r in rs),
        ),
    )
    for axis, (label, statistic) in zip(axes, panels, strict=True):
        for tuner in tuners:
            mine = [run for run in runs if run.tuner == tuner]
            style = {"linewidth": 2.2, "color": "black"} if tuner == "distune" else {}
            values = [statistic(mine, k) for k in budgets]
            axis.plot(budgets, values, marker=".", label=tuner, **style)
        axis.set_xscale("log")
        axis.set_xticks(budgets, [str(b) for b in budgets])
        axis.minorticks_off()
        axis.set_xlabel("samples (budget)")
        axis.set_title(label, fontsize=10)
        axis.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of the best group")
    axes[2].legend(fontsize=8, loc="lower right")
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def save_runs(runs: Sequence[Run], path: str) -> None:
    """Write ``runs`` to ``path`` as JSON, for ``load_runs`` to join with runs of other
    processes."""
    with open(path, "w", encoding="utf-8") as file:
        json.dump([dataclasses.asdict(run) for run in runs], file)


def load_runs(paths: Sequence[str]) -> list[Run]:
    """The runs saved in ``paths`` by ``save_runs``."""
    runs = []
    for path in paths:
        with open(path, encoding="utf-8") as file:
            for saved in json.load(file):
                runs.append(
                    Run(**{k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()})
                )
    return runs
