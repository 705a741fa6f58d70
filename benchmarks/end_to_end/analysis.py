"""What the end-to-end benchmark's raw outputs say: throughputs, ratios, tuning cost, bound.

* :func:`oracle_rates` reads the oracle sessions (``oracle.py``'s JSON): every variant's
  throughput over all its visits, and how much its rounds disagree.
* :func:`read_tuning_run` reads a ``distune-run --autotune_level 1`` run of the GPT example:
  the service's CSV log (what was sampled, when tuning completed) and node 0's progress lines
  (``step N loss L R it/s (group)`` every second), from which the run's timeline is rebuilt:
  each line covers ``delta steps / rate`` seconds since the one before.
* :func:`rate_row` puts one link rate's figures together; :func:`plot` draws them.
"""

from __future__ import annotations

import csv
import json
import math
import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.end_to_end.oracle import COMPUTE, TORCH, group_variant
from benchmarks.testbed.lower_bound import step_lower_bound
from benchmarks.testbed.rate import LinkRate
from benchmarks.tuner_quality.landscapes import Landscape
from distune.space import Hyperparameters, ModelFacts

_PROGRESS = re.compile(r"^step (\d+) loss \S+ ([\d.]+) it/s \((.*)\)\s*$")
#: Seconds after tuning completed before the final throughput is counted (the switch).
_SETTLE_SECONDS = 3.0


@dataclass(frozen=True)
class VariantRate:
    """One variant's throughput in iterations/s: all its timed steps over all their time;
    ``rounds`` the per-visit throughputs, ``stderr`` their standard error relative to it."""

    variant: str
    rate: float
    rounds: tuple[float, ...]

    @property
    def stderr(self) -> float:
        if len(self.rounds) < 2:
            return math.nan
        return statistics.stdev(self.rounds) / math.sqrt(len(self.rounds)) / self.rate


@dataclass(frozen=True)
class OracleSession:
    """The oracle sessions of one link rate, merged."""

    facts: ModelFacts
    default: str
    groups: dict[str, Hyperparameters]
    rates: dict[str, VariantRate]
    notes: dict[str, Any]

    @property
    def best(self) -> VariantRate:
        """The oracle: the fastest of distune's groups."""
        return max((self.rates[v] for v in self.groups), key=lambda r: r.rate)

    def landscape(self, name: str) -> Landscape:
        """The measured table, for the tuner-quality benchmark."""
        table = {hp: self.rates[v].rate for v, hp in self.groups.items()}
        return Landscape(name, self.facts, table)


def oracle_rates(paths: Sequence[Path]) -> OracleSession:
    """Merge oracle sessions (the same variants) into one throughput per variant."""
    if not paths:
        raise ValueError("no oracle session to read: the tables need one (--oracle-parts)")
    parts = [json.loads(path.read_text()) for path in paths]
    first = parts[0]
    steps: dict[str, int] = {}
    seconds: dict[str, float] = {}
    rounds: dict[str, list[float]] = {}
    for part in parts:
        for visit in part["visits"]:
            name = visit["variant"]
            steps[name] = steps.get(name, 0) + visit["steps"]
            seconds[name] = seconds.get(name, 0.0) + visit["seconds"]
            rounds.setdefault(name, []).append(visit["steps"] / visit["seconds"])
    rates = {
        name: VariantRate(name, steps[name] / seconds[name], tuple(rounds[name])) for name in steps
    }
    groups = {name: Hyperparameters.from_dict(hp) for name, hp in first["groups"].items()}
    notes = {
        "started": min(p["started"] for p in parts),
        "finished": max(p["finished"] for p in parts),
        "load_average": [p["load_average_before"][0] for p in parts]
        + [p["load_average_after"][0] for p in parts],
        "machine": first["machine"],
        "torch": first["torch"],
        "visits_per_variant": len(rounds[first["default_group"]]),
        "steps_per_visit": first["visits"][0]["steps"],
    }
    return OracleSession(ModelFacts(**first["facts"]), first["default_group"], groups, rates, notes)


@dataclass(frozen=True)
class TuningRun:
    """One tuned run of the GPT example under ``distune-run --autotune_level 1``."""

    chosen: Hyperparameters
    samples: int
    completed_iter: int
    completed_seconds: float
    tuning_rate: float
    final_rate: float
    gain_vs_default: float

    @property
    def variant(self) -> str:
        return group_variant(self.chosen)


def _timeline(log: str) -> list[tuple[int, float, float]]:
    """(step, seconds since training started, rate over the line's interval) per line."""
    points, last_step, now = [], 0, 0.0
    for line in log.splitlines():
        match = _PROGRESS.match(line)
        if match is None:
            continue
        step, rate = int(match[1]), float(match[2])
        if rate <= 0:
            continue
        now += (step - last_step) / rate
        last_step = step
        points.append((step, now, rate))
    return points


def _time_at(points: list[tuple[int, float, float]], step: int) -> float:
    previous_step, previous_time = 0, 0.0
    for at_step, at_time, _ in points:
        if at_step >= step:
            fraction = (step - previous_step) / max(1, at_step - previous_step)
            return previous_time + fraction * (at_time - previous_time)
        previous_step, previous_time = at_step, at_time
    raise ValueError(f"step {step} is past the last progress line ({previous_step})")


def read_tuning_run(node0_log: Path, autotune_csv: Path) -> TuningRun:
    """The tuned group, when tuning completed, and the throughput before and after."""
    rows = list(csv.DictReader(autotune_csv.open()))
    done = [row for row in rows if row["phase"] == "completed"]
    if not done:
        raise ValueError(f"{autotune_csv}: tuning did not complete; make the run longer")
    final = done[-1]
    chosen = Hyperparameters(
        int(final["bucket_size_2p"]), final["is_hierarchical_reduce"].lower() == "true"
    )
    completed_iter = int(final["train_iter"])
    points = _timeline(node0_log.read_text(errors="replace"))
    completed = _time_at(points, completed_iter)
    after = [(s, t) for s, t, _ in points if t >= completed + _SETTLE_SECONDS]
    if len(after) < 2:
        raise ValueError(f"{node0_log}: too little training after tuning completed")
    final_rate = (after[-1][0] - after[0][0]) / (after[-1][1] - after[0][1])
    return TuningRun(
        chosen=chosen,
        samples=sum(row["phase"] != "completed" for row in rows),
        completed_iter=completed_iter,
        completed_seconds=completed,
        tuning_rate=completed_iter / completed,
        final_rate=final_rate,
        gain_vs_default=float(final["gain_vs_default"]),
    )


@dataclass(frozen=True)
class RateRow:
    """One link rate's figures, for the table."""

    rate: LinkRate
    oracle: OracleSession
    runs: tuple[TuningRun, ...]

    def ratio(self, variant: str, to: str | None = None) -> float:
        """Throughput of ``variant`` over that of ``to`` (default: the oracle)."""
        base = self.oracle.best.rate if to is None else self.oracle.rates[to].rate
        return self.oracle.rates[variant].rate / base

    def ratio_text(self, variant: str, to: str | None = None) -> str:
        """:meth:`ratio` with its standard error (from the two variants' per-visit spread)."""
        base = self.oracle.best if to is None else self.oracle.rates[to]
        mine = self.oracle.rates[variant]
        if mine.variant == base.variant:
            return "1.000"
        error = math.hypot(mine.stderr, base.stderr)
        return f"{self.ratio(variant, to):.3f} ± {error * self.ratio(variant, to):.3f}"

    def tied_with_oracle(self) -> int:
        """How many of distune's groups are within two standard errors of the oracle's."""
        best = self.oracle.best
        return sum(
            best.rate - self.oracle.rates[v].rate
            <= 2 * best.rate * math.hypot(best.stderr, self.oracle.rates[v].stderr)
            for v in self.oracle.groups
        )

    def bound(self) -> tuple[float, str]:
        """The step's lower bound (seconds) and what sets it."""
        bound = step_lower_bound(
            compute_seconds=1.0 / self.oracle.rates[COMPUTE].rate,
            gradient_bytes=self.oracle.facts.gradient_bytes,
            nodes=self.oracle.facts.nnodes,
            ranks_per_node=self.oracle.facts.local_world_size,
            rate=self.rate,
        )
        return bound.seconds, bound.bound_by


def _short(variant: str) -> str:
    return variant.removeprefix("distune:")


def markdown(rows: Sequence[RateRow]) -> str:
    """The two tables of BENCHMARKS.md: throughput ratios, and tuning cost with the bound."""
    out = [
        "| link | oracle group (it/s) | groups within 2 s.e. of it | default / oracle "
        "| torch DDP / oracle | tuned group | tuned / oracle | tuned / default "
        "| tuned / torch DDP |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        best = row.oracle.best
        tuned = [run.variant for run in row.runs]
        out.append(
            f"| {row.rate} | {_short(best.variant)} ({best.rate:.3f} ± {best.stderr:.1%}) "
            f"| {row.tied_with_oracle()} of {len(row.oracle.groups)} "
            f"| {row.ratio_text(row.oracle.default)} | {row.ratio_text(TORCH)} "
            f"| {', '.join(_short(v) for v in tuned)} "
            f"| {', '.join(row.ratio_text(v) for v in tuned)} "
            f"| {', '.join(row.ratio_text(v, row.oracle.default) for v in tuned)} "
            f"| {', '.join(row.ratio_text(v, TORCH) for v in tuned)} |"
        )
    out += [
        "",
        "| link | tuning: s until completed (samples) | throughput while tuning / after "
        "| compute-only it/s | lower bound s/step (set by) | tuned step / bound |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        bound, by = row.bound()
        steps = [1.0 / row.oracle.rates[run.variant].rate for run in row.runs]
        out.append(
            f"| {row.rate} "
            f"| {', '.join(f'{r.completed_seconds:.0f} ({r.samples})' for r in row.runs)} "
            f"| {', '.join(f'{r.tuning_rate / r.final_rate:.3f}' for r in row.runs)} "
            f"| {row.oracle.rates[COMPUTE].rate:.3f} | {bound:.4f} ({by}) "
            f"| {', '.join(f'{s / bound:.2f}' for s in steps)} |"
        )
    return "\n".join(out)


def plot(rows: Sequence[RateRow], path: Path) -> None:
    """One panel per link rate: every group's throughput over the oracle's against the bucket
    size, flat and hierarchical (error bars: one standard error over the visits); torch DDP as
    a line; the default and the tuned groups marked."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figure, grid = plt.subplots(
        1, len(rows), figsize=(3.2 * len(rows), 3.0), dpi=100, squeeze=False, sharey=True
    )
    axes = list(grid[0])
    for axis, row in zip(axes, rows, strict=True):
        oracle = row.oracle.best.rate
        for shape, style in ((False, "o-"), (True, "s-")):
            points = sorted(
                (
                    hp.bucket_size_2p,
                    row.oracle.rates[v].rate / oracle,
                    row.oracle.rates[v].stderr * row.oracle.rates[v].rate / oracle,
                )
                for v, hp in row.oracle.groups.items()
                if hp.is_hierarchical_reduce is shape
            )
            label = "distune, hierarchical" if shape else "distune, flat"
            x, y, error = zip(*points, strict=True)
            axis.errorbar(x, y, yerr=error, fmt=style, markersize=3, capsize=2, label=label)
        axis.axhline(row.ratio(TORCH), color="tab:red", linestyle="--", label="torch DDP")
        default = row.oracle.groups[row.oracle.default]
        axis.plot(
            default.bucket_size_2p, row.ratio(row.oracle.default), "kD", label="default group"
        )
        for run in row.runs:
            axis.plot(
                run.chosen.bucket_size_2p, row.ratio(run.variant), "*", color="gold",
                markersize=13, markeredgecolor="black", label="tuned",
            )  # fmt: skip
        axis.set_title(f"{row.rate}", fontsize=10)
        axis.set_xlabel("log2 bucket size")
        axis.grid(alpha=0.3)
    first = axes[0]
    first.set_ylabel("throughput / oracle")
    handles, labels = first.get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=True))
    first.legend(unique.values(), unique.keys(), fontsize=6, loc="best")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
