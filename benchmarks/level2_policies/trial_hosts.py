"""Where the grid's trials run: on this node as level 2 runs them, or on every node of a
shaped testbed (one static-rendezvous job across the nodes' namespaces)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from torch.distributed.run import get_args_parser

from benchmarks.testbed.distune_job import launcher_argv
from benchmarks.testbed.network import Node, Testbed
from benchmarks.testbed.node_jobs import run_on_nodes
from distune.launcher.level2 import free_port
from distune.launcher.options import parse
from distune.launcher.trial_runner import (
    TrialRun,
    TrialRunner,
    classify,
    read_json_object,
    read_log_tail,
)
from distune.trial_settings import TrialSettings
from distune.tuning_service.trials.trial_result import OK
from distune.worker_settings import WorkerSettings

#: Rendezvous ports of testbed trials: a fresh one each (node 0's namespace has its own ports).
_FIRST_PORT = 29600


def testbed_environment() -> dict[str, str]:
    """Variables every testbed rank gets: one torch thread, as torchrun gives each rank when a
    node runs several (the testbed's nodes share this machine's cores; with one rank a node,
    torchrun would leave torch a thread per core in every rank, and they would fight)."""
    return {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


class LocalTrials:
    """Trials on this node, by level 2's own trial runner."""

    def __init__(self, launcher_args: list[str], trial_timeout: float, root: Path) -> None:
        args, _ = parse(launcher_args)
        self.runner = TrialRunner(args, trial_timeout, root)

    def run(self, index: int, settings: TrialSettings, script_args: list[str]) -> TrialRun:
        """Run trial ``index`` with level 2's runner (watchdog, stop by ids, classify)."""
        return self.runner.run(index, settings, script_args, free_port())


class TestbedTrials:
    """Trials as one job over every node of ``bed``: on each node torch's elastic launcher
    (``distune.launcher.trial_job``, as level 2 starts it) with static rendezvous at node 0,
    the trial's ``DISTUNE_*`` settings and one shared trial directory. The whole trial is
    stopped after ``trial_timeout`` seconds (``timeout``); the outcome comes from the ranks'
    reports and exit codes by level 2's own rule."""

    __test__ = False  # a name pytest would otherwise try to collect

    def __init__(
        self,
        bed: Testbed,
        launcher_args: list[str],
        nproc_per_node: int,
        trial_timeout: float,
        root: Path,
    ) -> None:
        self.bed = bed
        self.launcher_args = launcher_args
        self.nproc_per_node = nproc_per_node
        self.trial_timeout = trial_timeout
        self.root = root

    def spec(self, node: Node, script_args: list[str], port: int) -> dict[str, Any]:
        """torchrun's parsed arguments for ``node``'s part of the trial."""
        # The launcher's arguments as the testbed gives them to ``python -m distune.run``.
        argv = launcher_argv(node, self.nproc_per_node, self.launcher_args)[3:]
        args, _ = parse(argv)
        torchrun_dests = {action.dest for action in get_args_parser()._actions}
        spec = {k: v for k, v in vars(args).items() if k in torchrun_dests}
        spec.update(training_script_args=script_args, max_restarts=0, master_port=port)
        return spec

    def run(self, index: int, settings: TrialSettings, script_args: list[str]) -> TrialRun:
        """Run trial ``index`` on every node at once and classify it."""
        trial_dir = self.root / f"trial-{index:03d}"
        trial_dir.mkdir(parents=True)
        port = _FIRST_PORT + index
        specs = {}
        for node in self.bed.nodes:
            path = trial_dir / f"torchrun-node{node.rank}.json"
            path.write_text(json.dumps(self.spec(node, script_args, port)), encoding="utf-8")
            specs[node.rank] = path
        env = testbed_environment()
        env.update(WorkerSettings(autotune_level=0).to_env())  # no online tuning in a trial
        env.update(TrialSettings(**{**vars(settings), "trial_dir": trial_dir}).to_env())
        start = time.monotonic()
        results = run_on_nodes(
            self.bed.nodes,
            lambda node: _trial_job(specs[node.rank]),
            output_dir=trial_dir,
            timeout=self.trial_timeout,
            env=env,
        )
        timed_out = any(r.stopped == "timeout" for r in results)
        failed = [r.returncode for r in results if r.returncode != 0 and r.stopped is None]
        exit_code = failed[0] if failed else (0 if all(r.ok for r in results) else 1)
        reports = [r for p in sorted(trial_dir.glob("rank*.json")) if (r := read_json_object(p))]
        result = read_json_object(trial_dir / "result.json")
        log_path = results[0].output
        outcome, error = classify(exit_code, timed_out, reports, result, read_log_tail(log_path))
        return TrialRun(
            outcome=outcome,
            exit_code=exit_code,
            measurements=result if outcome == OK else None,
            error=error,
            duration=time.monotonic() - start,
            log_path=log_path,
        )


def _trial_job(spec: Path) -> list[str]:
    """The command that runs one node's part of a trial from its torchrun spec."""
    return [sys.executable, "-m", "distune.launcher.trial_job", str(spec)]
