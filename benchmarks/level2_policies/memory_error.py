"""The memory model's prediction error on measured grids, three ways: every configuration that
ran ok predicted from the profile trial alone (as the search first sees a family); the same
after one more trial of the profile's family (the second micro-batch whose slope the model
carries to the families not yet measured); and every trial that level 2's search, replayed on
the grid, launched, predicted as the search predicted it when it chose to launch it (an
out-of-memory trial there is a miss the search paid for)."""

from __future__ import annotations

from collections.abc import Iterator
from statistics import mean
from typing import Any

from benchmarks.level2_policies.policies import Grid, distune_policy
from benchmarks.level2_policies.report import single_passes
from distune.tuning_service.trials.memory_model import MemoryModel
from distune.tuning_service.trials.trial_config import TrialConfig
from distune.tuning_service.trials.trial_result import OK, OOM

MiB = 2**20

#: (configuration, predicted / measured - 1), or None where it ran out of memory.
Errors = list[tuple[TrialConfig, float | None]]


def _measured(grid: Grid) -> Iterator[tuple[TrialConfig, int]]:
    """Every configuration of the grid that ran ok, with its measured peak."""
    for config, row in sorted(grid.rows.items()):
        if row["outcome"] == OK and row["peak_memory_bytes"]:
            yield config, int(row["peak_memory_bytes"])


def prediction_errors(table: dict[str, Any]) -> list[tuple[str, float, float, float]]:
    """(configuration, predicted MiB, measured MiB, relative error) of every ok row, from the
    profile alone."""
    grid = Grid(table)
    model = MemoryModel(grid.facts)
    return [
        (
            config.describe(),
            model.predict(config) / MiB,
            peak / MiB,
            model.predict(config) / peak - 1,
        )
        for config, peak in _measured(grid)
    ]


def profile_errors(table: dict[str, Any]) -> Errors:
    """Every ok configuration predicted from the profile alone."""
    grid = Grid(table)
    model = MemoryModel(grid.facts)
    return [(config, model.predict(config) / peak - 1) for config, peak in _measured(grid)]


def second_point_errors(table: dict[str, Any]) -> Errors:
    """Every ok configuration of the families other than the profile's, predicted after the
    profile and one more ok trial of the profile's family with accumulation, each such trial in
    turn."""
    grid = Grid(table)
    profile = grid.profile
    family = (profile.stage, profile.checkpointing, profile.bf16)
    measured = list(_measured(grid))
    errors: Errors = []
    for second, second_peak in measured:
        if (second.stage, second.checkpointing, second.bf16) != family:
            continue
        if second.micro_batch == profile.micro_batch or second.accumulation == 1:
            continue
        model = MemoryModel(grid.facts)
        model.observe(profile, grid.facts.profile_peak_bytes)
        model.observe(second, second_peak)
        errors += [
            (config, model.predict(config) / peak - 1)
            for config, peak in measured
            if (config.stage, config.checkpointing, config.bf16) != family
        ]
    return errors


def replayed_errors(table: dict[str, Any]) -> Errors:
    """Every trial level 2's search launched when replayed on the grid (on the passes' mean and
    from each single pass), as the search predicted it."""
    errors: Errors = []
    for first_pass in [None, *single_passes(table)]:
        choice = distune_policy(Grid(table, first_pass))
        for result in choice.results[1:]:
            if result.purpose != "search" or result.predicted_memory_bytes is None:
                continue
            if result.outcome == OOM:
                errors.append((result.config, None))
            elif result.outcome == OK and result.peak_memory_bytes:
                errors.append(
                    (result.config, result.predicted_memory_bytes / result.peak_memory_bytes - 1)
                )
    return errors


def strategy_table(errors: Errors) -> str:
    """Rows, mean absolute error, largest under- and overestimate and out-of-memory trials by
    strategy (with and without checkpointing), as Markdown."""
    by_strategy: dict[str, list[float | None]] = {}
    for config, error in sorted(errors, key=lambda e: (e[0].checkpointing, e[0].stage)):
        name = config.strategy + (", checkpointing" if config.checkpointing else "")
        by_strategy.setdefault(name, []).append(error)
    lines = [
        "| strategy | rows | mean abs | largest under | largest over | out of memory |",
        "|---|---|---|---|---|---|",
    ]
    for name, values in [*by_strategy.items(), ("all", [e for _, e in errors])]:
        ran = [v for v in values if v is not None]
        if not ran:
            lines.append(f"| {name} | 0 | - | - | - | {len(values)} |")
            continue
        lines.append(
            f"| {name} | {len(ran)} | {100 * mean(abs(v) for v in ran):.1f} % | "
            f"{100 * min(ran):+.1f} % | {100 * max(ran):+.1f} % | {len(values) - len(ran)} |"
        )
    return "\n".join(lines)


def error_report(tables: list[dict[str, Any]]) -> str:
    """The three error tables by strategy over ``tables``, as Markdown."""
    sections = (
        ("From the profile alone", profile_errors),
        ("After one more micro-batch of the profile's family", second_point_errors),
        ("Trials the replayed search launched, as it predicted them", replayed_errors),
    )
    return "\n\n".join(
        f"{title}:\n\n" + strategy_table([e for table in tables for e in errors(table)])
        for title, errors in sections
    )


def error_summary(table: dict[str, Any]) -> str:
    """Mean absolute, largest over- and underestimate, and every row, as Markdown; then the
    errors by strategy."""
    rows = prediction_errors(table)
    errors = [e for *_, e in rows]
    average = 100 * mean(abs(e) for e in errors)
    lines = [
        f"{len(rows)} configurations: mean absolute error {average:.1f} %,"
        f" largest overestimate {100 * max(errors):+.1f} %,"
        f" largest underestimate {100 * min(errors):+.1f} %",
        "",
        "| configuration | predicted MiB | measured MiB | error |",
        "|---|---|---|---|",
    ]
    lines += [f"| {c} | {p:.1f} | {m:.1f} | {100 * e:+.1f} % |" for c, p, m, e in rows]
    return "\n".join(lines) + "\n\n" + error_report([table])
