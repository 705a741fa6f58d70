"""How much one configuration's throughput differs between a grid's passes."""

from __future__ import annotations

from statistics import mean, median
from typing import Any

from distune.tuning_service.trials.trial_config import TrialConfig


def relative_range(values: list[float]) -> float:
    """(max - min) / mean of ``values`` (0 for fewer than two)."""
    return (max(values) - min(values)) / mean(values) if len(values) >= 2 else 0.0


def noise_table(table: dict[str, Any]) -> str:
    """Markdown: every configuration measured ok in two passes or more, with its passes'
    throughputs, their range over their mean, and each pass's own interquartile spread
    (the steps of one trial); then the median and largest range."""
    lines = [
        "| configuration | passes (samples/s) | range / mean | IQR / median within a trial |",
        "|---|---|---|---|",
    ]
    ranges = []
    for row in table["rows"]:
        values = row.get("throughputs") or []
        if len(values) < 2:
            continue
        ranges.append(relative_range(values))
        passes = row.get("passes", [])
        spreads = [p.get("throughput_spread") for p in passes if p["outcome"] == "ok"]
        config = TrialConfig(*row["config"]).describe()
        lines.append(
            f"| {config} | {', '.join(f'{v:.1f}' for v in values)} | {ranges[-1]:.0%} | "
            f"{', '.join(f'{s:.0%}' for s in spreads if s is not None)} |"
        )
    if ranges:
        lines.append("\n" + noise_summary(table))
    return "\n".join(lines)


def pass_ranges(table: dict[str, Any]) -> list[float]:
    """The range of the passes over their mean of every configuration that ran ok in two
    passes or more: how far two runs of one configuration land apart."""
    return [
        relative_range(values)
        for row in table["rows"]
        if len(values := row.get("throughputs") or []) >= 2
    ]


def noise_summary(table: dict[str, Any]) -> str:
    """One line: how many configurations ran ok in two passes or more, and the median and
    largest range of their passes over their mean."""
    ranges = pass_ranges(table)
    if not ranges:
        return "no configuration ran ok in two passes"
    return (
        f"{len(ranges)} configurations: range / mean at the median {median(ranges):.0%}, "
        f"largest {max(ranges):.0%}"
    )
