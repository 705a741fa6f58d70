"""Fault injection: kill the service, a worker, or the launcher at random moments, many times.

Each run is a real ``distune-run`` of ``benchmarks/faults/deterministic_worker.py`` on 2 CPU
ranks (gloo), tuned online, with one fault injected (``benchmarks/faults/scenarios.py``):

* ``service-kill``: the tuning service SIGKILLed during warmup, mid-sample, right after it
  handed out a new group (a switch being applied), or after completion;
* ``worker-kill``: a worker SIGKILLed mid-sampling under ``--max_restarts 1``; and
  ``worker-kill-no-restart-left``: then a worker of the restarted job too. These jobs use a c10d
  rendezvous with a store per attempt (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``): with torchrun's
  default static rendezvous, torch 2.13 itself fails most gloo restarts (a restarted worker gets
  its predecessor's address from the reused store); ``--restart-rendezvous static`` shows it;
* ``launcher-signal``: SIGTERM, SIGINT or SIGHUP to the launcher at a random moment;
* ``stuck-rendezvous-signal``: the same to node 0 of a two-node job whose other node never
  comes (the launcher waits inside torch's C++ rendezvous).

It prints, per scenario: runs, hangs, failed exits, wrong final parameters (bit-compared with a
fault-free run), lost log rows, samples measured twice, wrong dead-service notices, leftover
processes; and writes every run's record as JSON. Usage::

    python -m benchmarks.fault_injection                      # everything, ~30 min loaded
    python -m benchmarks.fault_injection --scenario service-kill --runs 8 --seed 1
    python -m benchmarks.fault_injection --merge a.json b.json  # one table from batches
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from benchmarks.faults.job import WorkerSpec
from benchmarks.faults.scenarios import (
    MOMENTS,
    RunResult,
    launcher_signal,
    reference_digest,
    service_kill,
    stuck_rendezvous_signal,
    worker_kill,
)
from tests.support.launcher_process import RESTARTABLE

SCENARIOS = (
    "service-kill",
    "worker-kill",
    "worker-kill-no-restart-left",
    "launcher-signal",
    "stuck-rendezvous-signal",
)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
#: Runs per scenario unless --runs says otherwise (the issue asks for at least 20 kills).
DEFAULT_RUNS = {"service-kill": 24, "launcher-signal": 15}


def _plan(
    args: argparse.Namespace, spec: WorkerSpec, work: Path, reference: str | None
) -> list[Callable[[], RunResult]]:
    """One thunk per run, shuffled so that scenarios, moments and signals interleave."""
    rng = random.Random(args.seed)
    runs: list[Callable[[], RunResult]] = []
    for scenario in SCENARIOS if args.scenario == "all" else (args.scenario,):
        count = args.runs or DEFAULT_RUNS.get(scenario, 6)
        for index in range(count):
            where, seeded = work / f"{scenario}-{index}", random.Random(rng.random())
            sig = STOP_SIGNALS[index % len(STOP_SIGNALS)]
            if scenario == "service-kill":
                moment = MOMENTS[index % len(MOMENTS)]
                runs.append(partial(service_kill, moment, seeded, spec, where, reference))
            elif scenario.startswith("worker-kill"):
                exhaust = scenario.endswith("no-restart-left")
                rendezvous = RESTARTABLE if args.restart_rendezvous == "isolated" else "static"
                runs.append(
                    partial(worker_kill, seeded, spec, where, reference, exhaust, rendezvous)
                )
            elif scenario == "launcher-signal":
                runs.append(partial(launcher_signal, sig, seeded, spec, where))
            else:
                runs.append(partial(stuck_rendezvous_signal, sig, seeded, where))
    rng.shuffle(runs)
    return runs


def summarize(results: list[RunResult]) -> list[str]:
    """A Markdown table: one line per scenario and moment (or signal)."""
    lines = [
        "| scenario | moment | runs | hangs | failed exit | wrong params | lost rows | "
        "measured twice | notices != 1 | wrong kept group | leftovers | slowest stop (s) |",
        "|" + "---|" * 12,
    ]
    for scenario, moment in sorted({(r.scenario, r.moment) for r in results}):
        group = [r for r in results if (r.scenario, r.moment) == (scenario, moment)]
        failed_exit = sum(
            any(p.startswith("exit code") for p in r.problems) and not r.hang for r in group
        )
        killed = scenario == "service-kill"
        notices = sum(r.death_notices != 1 for r in group) if killed else "-"
        kept = sum(r.kept_group_right is False for r in group) if killed else "-"
        stops = [r.stop_seconds for r in group if r.stop_seconds is not None]
        slowest = f"{max(stops):.1f}" if stops else "-"
        lines.append(
            f"| {scenario} | {moment} | {len(group)} | {sum(r.hang for r in group)} | "
            f"{failed_exit} | {sum(bool(r.wrong_params) for r in group)} | "
            f"{sum(r.lost_rows for r in group)} | {sum(bool(r.repeated) for r in group)} | "
            f"{notices} | {kept} | {sum(r.leftovers for r in group)} | {slowest} |"
        )
    return lines


def _write_record(
    path: Path, argv: list[str], started: float, reference: str | None, results: list[RunResult]
) -> None:
    record = {
        "command": " ".join(["python -m benchmarks.fault_injection", *argv]),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(started)),
        "minutes": (time.time() - started) / 60,
        "machine": f"{platform.node()} {platform.machine()} {platform.platform()}",
        "reference_sha256": reference,
        "runs": [r.to_dict() for r in results],
        "table": summarize(results),
    }
    path.write_text(json.dumps(record, indent=1))


def merge(paths: list[Path]) -> int:
    """Print one table from the records of several invocations; exit 1 if a run had a problem."""
    results = [RunResult(**run) for path in paths for run in json.loads(path.read_text())["runs"]]
    print("\n".join(summarize(results)))
    return 1 if any(r.problems for r in results) else 0


def main(argv: list[str] | None = None) -> int:
    """Run the scenarios; exit 1 if any run had a problem."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scenario", choices=("all", *SCENARIOS), default="all")
    parser.add_argument("--runs", type=int, default=None, help="runs per scenario")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=WorkerSpec.steps, help="steps per job")
    parser.add_argument(
        "--json", type=Path, default=None, help="write every run's record here (after each run)"
    )
    parser.add_argument(
        "--merge", type=Path, nargs="+", default=None, help="print one table from these --json"
    )
    parser.add_argument(
        "--restart-rendezvous",
        choices=("isolated", "static"),
        default="isolated",
        help="worker-kill jobs: c10d with a store per attempt, or torchrun's default",
    )
    args = parser.parse_args(argv)
    if args.merge:
        return merge(args.merge)
    given = sys.argv[1:] if argv is None else argv
    spec = WorkerSpec(steps=args.steps)
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="distune_faults_") as temporary:
        work = Path(temporary)
        needs_reference = args.scenario in ("all", "service-kill", "worker-kill")
        reference = reference_digest(spec, work / "reference") if needs_reference else None
        if reference is not None:
            print(f"reference: tuned and untuned runs end with sha256 {reference[:16]}", flush=True)
        results: list[RunResult] = []
        runs = _plan(args, spec, work, reference)
        for index, run in enumerate(runs, 1):
            result = run()
            results.append(result)
            verdict = "ok" if not result.problems else "; ".join(result.problems)
            print(
                f"[{index}/{len(runs)}] {result.scenario} {result.moment} "
                f"(observed {result.observed}, {result.seconds:.0f} s): {verdict}",
                flush=True,
            )
            if args.json is not None:  # after each run: a batch cut short keeps what it did
                _write_record(args.json, given, started, reference, results)
    print("\n".join(summarize(results)))
    return 1 if any(r.problems for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
