"""Level 2's trials as ``distune status`` prints them, from the service's ``/api/v1/trials``.

One line about the tuning (its state, nodes, the running trial, the best or chosen trial), then
one row per recorded trial::

    level 2: tuning on 2 nodes; 3 trials recorded; trial 3 running (search, 4 x 2), 1 of 2
    nodes reported; best so far: trial 2
    TRIAL  PURPOSE  STRATEGY  MICRO x ACC  OUTCOME  THROUGHPUT      IQR  PREDICTED  MEASURED  BEST
    0      profile  ddp       2 x 4        ok       75.3 samples/s  4%   -          24.1 MiB
    1      search   ddp       8 x 1        oom      -               -    31.0 MiB   -
    2      search   zero1     4 x 2        ok       81.2 samples/s  6%   22.0 MiB   21.4 MiB  *
"""

from __future__ import annotations

from typing import Any

from distune.wording import counted

HEADER = (
    "TRIAL", "PURPOSE", "STRATEGY", "MICRO x ACC", "OUTCOME", "THROUGHPUT", "IQR",
    "PREDICTED", "MEASURED", "BEST",
)  # fmt: skip
_STRATEGIES = ("ddp", "zero1", "zero2", "zero3")


def _mib(value: Any) -> str:
    if not isinstance(value, int | float) or isinstance(value, bool):
        return "-"
    return f"{value / 2**20:.1f} MiB"


def _strategy(config: dict[str, Any]) -> str:
    stage = (config.get("zero_optimization") or {}).get("stage")
    name = _STRATEGIES[stage] if isinstance(stage, int) and 0 <= stage < 4 else "?"
    return f"{name}+ckpt" if config.get("activation_checkpointing") else name


def describe_config(config: Any) -> str:
    """``micro x accumulation`` of a trial's config keys, or ``script's own``."""
    if not isinstance(config, dict):
        return "script's own"
    micro = config.get("train_micro_batch_size_per_gpu", "?")
    accumulation = config.get("gradient_accumulation_steps", "?")
    return f"{micro} x {accumulation}"


def _throughput(record: dict[str, Any]) -> tuple[str, str]:
    rate = record.get("throughput")
    if not isinstance(rate, int | float) or isinstance(rate, bool):
        return "-", "-"
    spread = record.get("throughput_spread")
    # The interquartile range of the measured steps' throughput, relative to the median.
    spread_text = f"{100 * spread:.0f}%" if isinstance(spread, int | float) else "-"
    return f"{rate:.4g} samples/s", spread_text


def _headline(trials: dict[str, Any]) -> str:
    records = trials.get("trials") or []
    nodes = trials.get("nnodes")
    on = f" on {counted(nodes, 'node')}" if isinstance(nodes, int) else ""
    parts = [
        f"level 2: {trials.get('state', '?')}{on}",
        f"{counted(len(records), 'trial')} recorded",
    ]
    running = trials.get("running")
    if isinstance(running, dict):
        spec = running.get("spec") or {}
        reported = len(running.get("nodes") or {})
        what = describe_config(spec.get("config"))
        parts.append(
            f"trial {running.get('trial')} running ({spec.get('purpose', '?')}, {what}), "
            f"{reported} of {spec.get('nnodes', '?')} nodes reported"
        )
    best = trials.get("best")
    if best is not None:
        chosen = (trials.get("finish") or {}).get("chosen") == best
        parts.append(f"{'chosen' if chosen else 'best so far'}: trial {best}")
    stop = trials.get("stop")
    if isinstance(stop, dict):
        parts.append(f"stopped by node {stop.get('node_rank')} ({stop.get('reason')})")
    return "; ".join(parts)


def format_trials(trials: dict[str, Any] | None) -> str | None:
    """The trials document as a headline and an aligned table; None when there are none."""
    if not trials or (trials.get("state") == "waiting" and not trials.get("trials")):
        return None
    rows = [HEADER]
    best = trials.get("best")
    for record in trials.get("trials") or []:
        config = record.get("config")
        # A failed profile holds 1 for each knob nothing told, not the script's own.
        unmeasured = record.get("purpose") == "profile" and record.get("outcome") != "ok"
        rate, spread = _throughput(record)
        rows.append(
            (
                str(record.get("trial", "?")),
                str(record.get("purpose", "?")),
                _strategy(config) if isinstance(config, dict) else "?",
                describe_config(None if unmeasured else config),
                str(record.get("outcome", "?")),
                rate,
                spread,
                _mib(record.get("predicted_memory_bytes")),
                _mib(record.get("peak_memory_bytes")),
                "*" if record.get("trial") == best else "",
            )
        )
    lines = [_headline(trials)]
    if len(rows) > 1:
        widths = [max(len(row[column]) for row in rows) for column in range(len(HEADER))]
        lines += [
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
            for row in rows
        ]
    return "\n".join(lines)
