"""``python -m benchmarks.end_to_end``: the GPT example on the shaped testbed, 2 nodes x 2 ranks.

For each link rate, on one testbed, alternating:

* oracle sessions (``oracle.py`` under torchrun on both nodes): every group of distune's space,
  torch DDP at its defaults and compute only, interleaved round by round in one job;
* tuned runs: ``distune-run --autotune_level 1 examples/train_gpt.py`` with the shipped tuning
  settings, its CSV log and node 0's progress lines kept.

Then it prints the tables of BENCHMARKS.md (throughput ratios from the oracle sessions, the tuned
group's ratio read from the same sessions; tuning cost from the tuned runs; the step's lower
bound), draws the plot, and writes each rate's oracle table for the tuner-quality benchmark.
Needs root (network namespaces)::

    .venv/bin/python -m benchmarks.end_to_end --output /tmp/e2e \\
        --plot docs/images/bench_end_to_end.png \\
        --oracle-tables benchmarks/tuner_quality/oracle_tables
    .venv/bin/python -m benchmarks.end_to_end --output /tmp/e2e --report-only   # re-read

Every raw output stays under ``--output`` (``<rate>/oracle<i>.json``, ``<rate>/tune<i>/``).
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import datetime, timezone
from pathlib import Path

from benchmarks.end_to_end.analysis import RateRow, markdown, oracle_rates, plot, read_tuning_run
from benchmarks.testbed import DISTUNE_RUN, TORCHRUN, Testbed, TestbedError, run_distune
from benchmarks.testbed.rate import LinkRate

ORACLE = Path(__file__).with_name("oracle.py")
NODES, RANKS_PER_NODE = 2, 2


def _check(results: list, what: str) -> None:
    failed = [r for r in results if not r.ok]
    if failed:
        tail = failed[0].read_output().splitlines()[-15:]
        raise TestbedError(f"{what} failed on node {failed[0].rank}:\n" + "\n".join(tail))


def measure_rate(rate: LinkRate, args: argparse.Namespace) -> None:
    """Run the oracle sessions and tuned runs of one link rate, alternating."""
    directory = args.output / str(rate)
    directory.mkdir(parents=True, exist_ok=True)
    with Testbed(NODES, rate) as bed:
        print(bed.describe(), flush=True)
        for index in range(max(args.oracle_parts, args.tune_runs)):
            if index < args.oracle_parts:
                started = datetime.now(timezone.utc).strftime("%H:%M:%S")
                print(f"{rate}: oracle session {index} ({started} UTC)", flush=True)
                oracle = [
                    str(ORACLE), "--rounds", str(args.rounds), "--steps", str(args.steps),
                    "--warmup-steps", str(args.warmup_steps), "--seed", str(index),
                    "--output", str(directory / f"oracle{index}.json"),
                ]  # fmt: skip
                results = run_distune(
                    bed, oracle, nproc_per_node=RANKS_PER_NODE, launcher=TORCHRUN,
                    output_dir=directory / f"oracle{index}", timeout=args.timeout,
                )  # fmt: skip
                _check(results, f"{rate} oracle session {index}")
            if index < args.tune_runs:
                started = datetime.now(timezone.utc).strftime("%H:%M:%S")
                print(f"{rate}: tuned run {index} ({started} UTC)", flush=True)
                out = directory / f"tune{index}"
                out.mkdir(parents=True, exist_ok=True)
                job = [
                    "--autotune_level", "1", "--autotune_log_file", str(out / "autotune.csv"),
                    "--autotune_best_file", str(out / "best.json"),
                    "examples/train_gpt.py", "--seconds", str(args.tune_seconds),
                    "--log-every", "1",
                ]  # fmt: skip
                results = run_distune(
                    bed, job, nproc_per_node=RANKS_PER_NODE, launcher=DISTUNE_RUN,
                    output_dir=out, timeout=args.tune_seconds + args.timeout,
                )  # fmt: skip
                _check(results, f"{rate} tuned run {index}")


def report(args: argparse.Namespace) -> list[RateRow]:
    """Read every rate's raw outputs back into table rows."""
    rows = []
    for rate in args.rates:
        directory = args.output / str(rate)
        oracle = oracle_rates(sorted(directory.glob("oracle*.json")))
        runs = tuple(
            read_tuning_run(tune / "node0.log", tune / "autotune.csv")
            for tune in sorted(directory.glob("tune*"))
            if tune.is_dir()
        )
        rows.append(RateRow(rate, oracle, runs))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.end_to_end")
    parser.add_argument(
        "--rates", nargs="+", type=LinkRate.parse, default=[LinkRate.parse(r) for r in
                                                             ("1gbit", "2gbit", "5gbit")],
        help="link rates (default 1gbit 2gbit 5gbit)",
    )  # fmt: skip
    parser.add_argument("--output", type=Path, required=True, help="raw outputs go here")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per oracle session")
    parser.add_argument("--oracle-parts", type=int, default=2, help="oracle sessions per rate")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per visit")
    parser.add_argument("--warmup-steps", type=int, default=2, help="untimed steps per visit")
    parser.add_argument("--tune-runs", type=int, default=2, help="tuned runs per rate")
    parser.add_argument(
        "--tune-seconds", type=float, default=180.0, help="training time of a tuned run"
    )
    parser.add_argument("--timeout", type=float, default=900.0, help="limit per session (s)")
    parser.add_argument("--report-only", action="store_true", help="only read --output back")
    parser.add_argument("--plot", type=Path, help="draw the landscapes here (PNG)")
    parser.add_argument(
        "--oracle-tables", type=Path, help="write each rate's measured table here (JSON)"
    )
    args = parser.parse_args(argv)

    if not args.report_only:
        for rate in args.rates:
            measure_rate(rate, args)
        if args.oracle_parts == 0:
            print(f"no oracle sessions, so no tables: the tuned runs are under {args.output}")
            return 0
    rows = report(args)
    first = rows[0].oracle.notes
    print(
        f"\n# End to end: GPT example, {NODES} nodes x {RANKS_PER_NODE} ranks, "
        f"{first['machine']}, torch {first['torch']}"
    )
    for row in rows:
        notes = row.oracle.notes
        print(
            f"{row.rate}: {notes['started']} to {notes['finished']}, "
            f"{notes['visits_per_variant']} visits x {notes['steps_per_visit']} steps per "
            f"variant, 1-min load average {min(notes['load_average']):.1f}-"
            f"{max(notes['load_average']):.1f}"
        )
    print()
    print(markdown(rows))
    if args.plot:
        plot(rows, args.plot)
    if args.oracle_tables:
        args.oracle_tables.mkdir(parents=True, exist_ok=True)
        for row in rows:
            name = f"testbed-2x2-gpt-{row.rate}"
            row.oracle.landscape(name).dump(
                args.oracle_tables / f"{name}.json",
                unit="iterations/s",
                source="python -m benchmarks.end_to_end (oracle sessions)",
                measured=f"{row.oracle.notes['started']} to {row.oracle.notes['finished']}",
                machine=row.oracle.notes["machine"],
                load_average=row.oracle.notes["load_average"],
                cpu_count=os.cpu_count(),
            )
    if args.output.is_dir():
        summary = args.output / "summary.md"
        summary.write_text(markdown(rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
