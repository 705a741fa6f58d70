"""The memory model's prediction error on a measured grid: every configuration that ran ok,
predicted from the profile trial alone (before any trial of its family, as the search first
sees it) against its measured peak."""

from __future__ import annotations

from statistics import mean
from typing import Any

from benchmarks.level2_policies.policies import Grid
from distune.tuning_service.trials.memory_model import MemoryModel
from distune.tuning_service.trials.trial_result import OK

MiB = 2**20


def prediction_errors(table: dict[str, Any]) -> list[tuple[str, float, float, float]]:
    """(configuration, predicted MiB, measured MiB, relative error) of every ok row."""
    grid = Grid(table)
    model = MemoryModel(grid.facts)
    rows = []
    for config, row in sorted(grid.rows.items()):
        if row["outcome"] != OK or not row["peak_memory_bytes"]:
            continue
        predicted, measured = model.predict(config), float(row["peak_memory_bytes"])
        rows.append((config.describe(), predicted / MiB, measured / MiB, predicted / measured - 1))
    return rows


def error_summary(table: dict[str, Any]) -> str:
    """Mean absolute, largest over- and underestimate, and every row, as Markdown."""
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
    return "\n".join(lines)
