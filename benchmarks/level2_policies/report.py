"""Every figure the issue's first "Done when" item asks of one measured grid, with its verdict.

The bar, for each real level-2 run of the grid: its choice is at least 0.97 of the grid's best,
in fewer trials and less time than the DeepSpeed-style policy, and faster than hand-tuning (its
choice has the higher grid throughput by more than the grid's noise: two runs of one
configuration land apart by the median range of its passes, so a smaller difference is a tie,
not faster). A real run is judged against the policies replayed on the passes' mean; the
replays on single passes show how much a policy's trials and choice move with the pass it
happens to see.
"""

from __future__ import annotations

from statistics import median
from typing import Any

from benchmarks.level2_policies.noise import noise_summary, pass_ranges
from benchmarks.level2_policies.policies import (
    Choice,
    Grid,
    compare_table,
    deepspeed_policy,
    hand_tuning_policy,
    real_runs,
)
from distune.tuning_service.trials.trial_config import TrialConfig

#: The share of the grid's best a real run's choice must reach.
BAR = 0.97


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def faster(value: float, other: float, noise: float | None) -> str:
    """Whether ``value`` is faster than ``other`` by more than ``noise`` (a range over a mean,
    as two runs of one configuration differ; None: never measured twice, so any difference
    counts): "met", a tie, or "NOT met"."""
    if value <= other:
        return _met(False)
    apart = (value - other) / ((value + other) / 2)
    if noise is not None and apart <= noise:
        return f"a tie, {apart:.1%} apart within the noise ({noise:.1%}): NOT met"
    return _met(True)


def _load_line(table: dict[str, Any]) -> str:
    """The 1-minute load averages at each pass's start and end, and around each real run."""
    loads = table.get("load_average", [])
    parts = [
        f"pass {index} {start[0]:.1f} -> {end[0]:.1f}"
        for index, (start, end) in enumerate(zip(loads[::2], loads[1::2], strict=False), 1)
    ]
    for index, run in enumerate(table.get("level2_runs", []), 1):
        if run.get("load_average"):
            before, after = run["load_average"]
            parts.append(f"real run {index} {before[0]:.1f} -> {after[0]:.1f}")
    return "1-minute load averages: " + ("; ".join(parts) if parts else "not recorded")


def _priced(seconds: float | None, deepspeed_seconds: float) -> str:
    if seconds is None:
        return ""
    return (
        f"; its trials at the grid's mean durations {seconds:.0f} s: "
        f"{_met(seconds < deepspeed_seconds)}"
    )


def single_passes(table: dict[str, Any]) -> list[int]:
    """The passes a single-pass replay can start from (none for a one-pass grid)."""
    passes = int(table.get("passes", 1))
    return list(range(passes)) if passes > 1 else []


def priced_seconds(grid: Grid, run: dict[str, Any]) -> float | None:
    """A real run's trials priced at the grid's mean duration of each configuration (the
    profile at the profile's): its time as the replays count theirs, free of the load the run
    itself met. None if a trial's configuration is not in the grid."""
    total = 0.0
    for row in run.get("rows", []):
        if row.get("purpose") == "profile":
            total += float(grid.profile_row["duration"])
            continue
        config = TrialConfig.from_config(row["config"])
        if config not in grid.rows:
            return None
        total += float(grid.rows[config]["duration"])
    return total if run.get("rows") else None


def verdict(table: dict[str, Any]) -> str:
    """Each real level-2 run of ``table`` against the bar, clause by clause."""
    grid = Grid(table)
    top = grid.throughput(grid.best())
    deepspeed, hand = deepspeed_policy(grid), hand_tuning_policy(grid)
    singles = [deepspeed_policy(Grid(table, n)) for n in single_passes(table)]
    single_trials = ", ".join(f"{c.trials}" for c in singles)
    single_seconds = ", ".join(f"{c.seconds:.0f}" for c in singles)
    of_single = f" (single passes: {single_trials})" if singles else ""
    of_single_s = f" (single passes: {single_seconds} s)" if singles else ""

    def share(choice: Choice) -> float:
        return grid.throughput(choice.chosen) / top

    def named(choice: Choice) -> str:
        return choice.chosen.describe() if choice.chosen is not None else "nothing"

    ranges = pass_ranges(table)
    noise = median(ranges) if ranges else None
    lines = []
    for run, measured in zip(real_runs(table), table.get("level2_runs", []), strict=True):
        when = "a later run, NOT side by side" if measured.get("later") else "side by side"
        lines += [
            f"{run.policy} ({when}): chose {named(run)}, {share(run):.2f} of the grid's best "
            f"({grid.best().describe()})",
            f"- at least {BAR} of the best: {_met(share(run) >= BAR)}",
            f"- fewer trials than DeepSpeed-style ({named(deepspeed)}, {share(deepspeed):.2f}): "
            f"{run.trials} against {deepspeed.trials}{of_single}: "
            f"{_met(run.trials < deepspeed.trials)}",
            f"- less time than DeepSpeed-style: {run.seconds:.0f} s against "
            f"{deepspeed.seconds:.0f} s{of_single_s}: {_met(run.seconds < deepspeed.seconds)}"
            + _priced(priced_seconds(grid, measured), deepspeed.seconds),
            f"- faster than hand-tuning ({named(hand)}): {share(run):.2f} against "
            f"{share(hand):.2f} of the best: {faster(share(run), share(hand), noise)}",
        ]
    if not lines:
        return "no real level-2 run in this grid (`measure --level2`, or `level2 GRID`)"
    return "\n".join(lines)


def report(table: dict[str, Any]) -> str:
    """The grid's comparison on the passes' mean and on single passes, its noise, the load
    averages and the verdict: everything the bar needs, from one grid."""
    cap = table.get("cap")
    cap_text = f"cap {cap / 2**20:.0f} MiB" if cap else "no cap"
    sections = [
        f"{table.get('host', 'one node')}, {cap_text}, {len(table['rows'])} configurations "
        f"(the profile included), {table.get('passes', 1)} pass(es), "
        f"{table.get('seconds', 0.0) / 60:.0f} minutes",
        "Policies replayed on the mean of the passes; real level-2 runs with their own trials:",
        compare_table(table),
    ]
    for first in single_passes(table):
        sections += [
            f"Replayed on single passes (first measurements from pass {first + 1}):",
            compare_table(table, first),
        ]
    sections += [noise_summary(table), _load_line(table), "The bar:", verdict(table)]
    return "\n\n".join(sections)
