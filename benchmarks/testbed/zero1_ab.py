"""The paired A/B of zero1's broadcast over whole trials: bucket view against stock, by round.

Each round is two one-pass ``measure --only ...`` runs of one job on the testbed, one per
variant (``ZERO1_AB_BUCKET_VIEW=0`` and ``1`` with ``benchmarks/testbed/zero1_variant`` first on
``PYTHONPATH``), in the order A B, B A, A B, ... Their directories are named ``rNN-v0`` (stock)
and ``rNN-v1`` (bucket view). This prints, for every configuration measured (the profile trial
included, which is the control when it has no ZeRO), each round's pair and the geometric mean of
the paired ratios bucket view / stock with its 95 % t-interval and a Wilcoxon signed-rank p, and
for every zero1 configuration its ratio to the DDP control in the same run::

    .venv/bin/python -m benchmarks.testbed.zero1_ab /tmp/i13t/ab
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
from collections.abc import Sequence
from pathlib import Path

from scipy import stats

from distune.tuning_service.trials.trial_config import TrialConfig

_RUN = re.compile(r"^r(?P<round>\d+)-v(?P<variant>[01])$")
#: A run's throughputs (samples/s) and peak memory (bytes) by configuration name.
Run = dict[str, tuple[float, int]]


def read_runs(root: Path) -> dict[tuple[int, int], Run]:
    """Every finished run under ``root`` by (round, variant): its ok rows' throughput and peak."""
    runs: dict[tuple[int, int], Run] = {}
    for grid in sorted(root.glob("r*-v*/grid.json")):
        match = _RUN.match(grid.parent.name)
        if match is None:
            continue
        table = json.loads(grid.read_text(encoding="utf-8"))
        runs[(int(match["round"]), int(match["variant"]))] = {
            TrialConfig(*row["config"]).describe(): (row["throughput"], row["peak_memory_bytes"])
            for row in table["rows"]
            if row["outcome"] == "ok"
        }
    return runs


def geometric_interval(ratios: Sequence[float]) -> tuple[float, float, float]:
    """The geometric mean of ``ratios`` and its 95 % t-interval."""
    logs = [math.log(r) for r in ratios]
    mean = statistics.mean(logs)
    half = stats.t.ppf(0.975, len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def compare(runs: dict[tuple[int, int], Run]) -> list[str]:
    """The report's lines: rounds, paired ratios, ratios to the control, peaks."""
    rounds = sorted(r for r, v in runs if v == 0 and (r, 1) in runs)
    if len(rounds) < 2:
        raise SystemExit(f"need at least 2 complete rounds (both variants), got {len(rounds)}")
    names = sorted({name for r in rounds for v in (0, 1) for name in runs[(r, v)]})
    lines = ["| round | " + " | ".join(f"{n}: stock / bucket" for n in names) + " |"]
    lines.append("|---" * (len(names) + 1) + "|")
    for r in rounds:
        cells = [
            f"{runs[(r, 0)][n][0]:.1f} / {runs[(r, 1)][n][0]:.1f}"
            if n in runs[(r, 0)] and n in runs[(r, 1)]
            else "-"
            for n in names
        ]
        lines.append(f"| {r} | " + " | ".join(cells) + " |")
    lines.append("")
    for n in names:
        ratios = [
            runs[(r, 1)][n][0] / runs[(r, 0)][n][0]
            for r in rounds
            if n in runs[(r, 0)] and n in runs[(r, 1)]
        ]
        mean, low, high = geometric_interval(ratios)
        wilcoxon = stats.wilcoxon([math.log(x) for x in ratios]).pvalue
        lines.append(
            f"{n}: bucket / stock {mean:.3f} (95 % {low:.3f}-{high:.3f}), n = {len(ratios)}, "
            f"Wilcoxon p = {wilcoxon:.4f}"
        )
    controls = [n for n in names if n.startswith("ddp") and "checkpointing" not in n]
    for control in controls[:1]:
        for n in (n for n in names if n.startswith("zero1")):
            for variant, label in ((0, "stock"), (1, "bucket view")):
                shares = sorted(
                    runs[(r, variant)][n][0] / runs[(r, variant)][control][0] for r in rounds
                )
                lines.append(
                    f"{n} / {control} in the same run, {label}: median "
                    f"{statistics.median(shares):.3f} ({shares[0]:.3f}-{shares[-1]:.3f})"
                )
    for n in names:
        peaks = {v: {runs[(r, v)][n][1] for r in rounds if n in runs[(r, v)]} for v in (0, 1)}
        lines.append(f"{n} peak bytes: stock {sorted(peaks[0])}, bucket view {sorted(peaks[1])}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """Print the comparison of the runs under the directory given."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("root", type=Path, help="the directory holding rNN-v0 and rNN-v1")
    args = parser.parse_args(argv)
    print("\n".join(compare(read_runs(args.root))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
