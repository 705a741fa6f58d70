"""Level 2's search against a DeepSpeed-style policy and the seed's hand-tuning policy.

    .venv/bin/python -m benchmarks.level2_policies measure [--passes 2] [--level2] \\
        [--testbed 1gbit --nodes 2 --nproc-per-node 1] OUT_DIR -- DISTUNE_RUN_ARGS...
    .venv/bin/python -m benchmarks.level2_policies level2 [--testbed ...] OUT_DIR/grid.json \\
        -- DISTUNE_RUN_ARGS...
    .venv/bin/python -m benchmarks.level2_policies replay [--cap-mib N] [--first-pass N] GRID
    .venv/bin/python -m benchmarks.level2_policies memory [--cap-mib N] GRID [GRID ...]
    .venv/bin/python -m benchmarks.level2_policies noise OUT_DIR/grid.json
    .venv/bin/python -m benchmarks.level2_policies report OUT_DIR/grid.json

``measure`` runs the exhaustive grid of the job's level-2 space as real trials, in passes, and
with ``--level2`` a real ``distune-run --autotune_level 2 --autotune_mode tune`` of the same job
between passes (after the only pass if there is one), so all of it is measured side by side;
with ``--testbed RATE`` every trial and the level-2 run are multi-node jobs on the shaped
testbed (needs root). ``level2`` adds a later real level-2 run to a measured grid. ``replay``
runs every policy against the grid and prints the comparison as a Markdown table; ``memory``
prints the memory model's prediction error on the grid's configurations (with several grids,
by strategy over all of them; ``--cap-mib`` replays each as if under a smaller cap);
``noise`` how much a configuration's passes differ; ``report`` everything the issue's bar asks
of the grid (the comparison on the passes' mean and on each single pass, the noise, the load
averages, and each real run's verdict), which ``measure`` and ``level2`` print at the end.
``measure --only zero3:16x1 ...`` measures only the named configurations (a noise check).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torch.distributed.run import determine_local_world_size

from benchmarks.level2_policies.grid import (
    GridMeasurement,
    Trials,
    load_average,
    measure_grid,
    parse_config,
)
from benchmarks.level2_policies.level2_run import level2_argv, run_level2_local, summarize
from benchmarks.level2_policies.memory_error import error_report, error_summary
from benchmarks.level2_policies.noise import noise_table
from benchmarks.level2_policies.policies import compare_table, table_at_cap
from benchmarks.level2_policies.report import report
from benchmarks.level2_policies.trial_hosts import LocalTrials, TestbedTrials, testbed_environment
from benchmarks.testbed.distune_job import run_distune
from benchmarks.testbed.network import Testbed
from benchmarks.testbed.rate import rate_argument
from distune.launcher.options import parse

_LEVEL2_TIMEOUT = 3 * 3600.0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    hosts = argparse.ArgumentParser(add_help=False)
    hosts.add_argument(
        "--testbed",
        type=rate_argument,
        default=None,
        metavar="RATE",
        help="run on the shaped testbed with links of this rate (1gbit)",
    )
    hosts.add_argument("--nodes", type=int, default=2, help="testbed nodes (default 2)")
    hosts.add_argument(
        "--nproc-per-node", type=int, default=1, help="testbed ranks per node (default 1)"
    )
    hosts.add_argument(
        "--trial-timeout",
        type=float,
        default=240.0,
        help="seconds a grid trial may take (default 240)",
    )
    measure = commands.add_parser("measure", parents=[hosts], help="measure the grid")
    measure.add_argument("out", type=Path)
    measure.add_argument("--passes", type=int, default=1, help="grid passes (default 1)")
    measure.add_argument(
        "--level2", action="store_true", help="run level 2 itself between the passes"
    )
    measure.add_argument(
        "--only",
        type=parse_config,
        action="append",
        metavar="STRATEGY:MICROxACC[:ckpt][:bf16]",
        help="measure only this configuration (repeatable): a noise check, not a grid",
    )
    level2 = commands.add_parser("level2", parents=[hosts], help="add a level-2 run to a grid")
    level2.add_argument("grid", type=Path)
    level2.add_argument(
        "--label", default=None, help="what the table says of this run (e.g. which search)"
    )
    for command in (measure, level2):  # options go before the positional: the rest is the job's
        command.add_argument("launcher_argv", nargs=argparse.REMAINDER)
    replay = commands.add_parser("replay", help="replay the policies against a grid")
    replay.add_argument("grid", type=Path)
    replay.add_argument(
        "--cap-mib",
        type=int,
        default=None,
        help="replay as if under this smaller cap (MiB; peaks over it are oom)",
    )
    replay.add_argument(
        "--first-pass",
        type=int,
        default=None,
        metavar="N",
        help="policies see single passes (first measurements pass N, re-measures the next) "
        "instead of the passes' mean",
    )
    memory = commands.add_parser("memory", help="the memory model's error on grids")
    memory.add_argument("grids", type=Path, nargs="+")
    memory.add_argument(
        "--cap-mib",
        type=int,
        default=None,
        help="as if every grid ran under this smaller cap (MiB; peaks over it are oom)",
    )
    noise = commands.add_parser("noise", help="how much the grid's passes differ")
    noise.add_argument("grid", type=Path)
    everything = commands.add_parser("report", help="every figure of the bar, and its verdict")
    everything.add_argument("grid", type=Path)
    return parser  # fmt: skip


class _Host:
    """This node, or a testbed that is up, for the grid's trials and the level-2 runs."""

    def __init__(self, args: argparse.Namespace, argv: list[str], out: Path) -> None:
        self.args = args
        self.argv = argv
        self.out = out
        self.bed: Testbed | None = None

    @contextlib.contextmanager
    def up(self) -> Iterator[_Host]:
        if self.args.testbed is None:
            yield self
            return
        with Testbed(self.args.nodes, self.args.testbed) as bed:
            self.bed = bed
            print(bed.describe(), flush=True)
            yield self

    def world_size(self) -> int:
        if self.bed is None:
            launcher, _ = parse(self.argv)
            return determine_local_world_size(launcher.nproc_per_node)
        return self.args.nodes * self.args.nproc_per_node

    def trials(self) -> Trials:
        root = self.out / "trials"
        if self.bed is None:
            return LocalTrials(self.argv, self.args.trial_timeout, root)
        return TestbedTrials(
            self.bed, self.argv, self.args.nproc_per_node, self.args.trial_timeout, root
        )

    def level2(self, name: str) -> dict[str, Any]:
        """One real level-2 run of the job, with the load average before and after."""
        results = self.out / name
        before = load_average()
        print(f"level 2 run into {results}", flush=True)
        if self.bed is None:
            summary = run_level2_local(self.argv, results, self.out / f"{name}.log")
        else:
            start = time.monotonic()
            nodes = run_distune(
                self.bed,
                level2_argv(self.argv, results),
                nproc_per_node=self.args.nproc_per_node,
                output_dir=self.out / f"{name}-nodes",
                timeout=_LEVEL2_TIMEOUT,
                env=testbed_environment(),
            )
            summary = summarize(results, time.monotonic() - start, [n.returncode for n in nodes])
        print(f"level 2: {summary['trials']} trials, chose {summary['chosen']}", flush=True)
        return {**summary, "load_average": [before, load_average()]}


def _at_cap(table: dict[str, Any], cap_mib: int | None) -> dict[str, Any]:
    """``table`` as if under ``cap_mib`` (unchanged if None), or exit saying why not."""
    if cap_mib is None:
        return table
    try:
        return table_at_cap(table, cap_mib * 2**20)
    except ValueError as error:
        raise SystemExit(f"--cap-mib {cap_mib}: {error}") from None


def main() -> None:
    args = _parser().parse_args()
    if args.command == "memory":
        tables = [
            _at_cap(json.loads(path.read_text(encoding="utf-8")), args.cap_mib)
            for path in args.grids
        ]
        print(error_summary(tables[0]) if len(tables) == 1 else error_report(tables))
        return
    if args.command in ("replay", "noise", "report"):
        table = json.loads(args.grid.read_text(encoding="utf-8"))
        if args.command != "replay":
            shown = {"noise": noise_table, "report": report}
            print(shown[args.command](table))
            return
        print(compare_table(_at_cap(table, args.cap_mib), args.first_pass))
        return
    argv = [a for a in args.launcher_argv if a != "--"]
    if args.command == "measure":
        args.out.mkdir(parents=True, exist_ok=True)
        with _Host(args, argv, args.out).up() as host:
            grid = GridMeasurement(argv, host.trials(), host.world_size(), args.only)
            runs: list[dict[str, Any]] = []

            def between(index: int) -> None:
                if args.level2:
                    runs.append(host.level2(f"level2-{index + 1}"))

            def save(table: dict[str, Any]) -> None:
                table["level2_runs"] = runs
                table["host"] = f"testbed {args.testbed}" if args.testbed else "one node"
                (args.out / "grid.json").write_text(json.dumps(table, indent=1), "utf-8")

            table = measure_grid(grid, args.passes, between, save)
            if args.level2 and args.passes == 1:
                runs.append(host.level2("level2-1"))
        save(table)
        print(noise_table(table) if args.only else report(table))
        return
    table = json.loads(args.grid.read_text(encoding="utf-8"))
    out = args.grid.parent
    with _Host(args, argv, out).up() as host:
        run = host.level2(f"level2-{len(table.get('level2_runs', [])) + 1}")
    table.setdefault("level2_runs", []).append({**run, "later": True, "label": args.label})
    args.grid.write_text(json.dumps(table, indent=1), encoding="utf-8")
    print(report(table))


if __name__ == "__main__":
    main()
