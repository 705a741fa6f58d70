"""deploy/slurm/distune.sbatch: shellcheck-clean, and the command line it gives each node parses
with distune-run's own parser and places the tuning service on the first host.

The script runs for real under bash with the SLURM variables of a two-node allocation; stand-ins
for ``scontrol`` and ``srun`` record instead of scheduling, and a stand-in ``distune-run``
records what each node's task would run (tests/e2e/test_slurm_recipe.py runs the real job).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from itertools import takewhile
from pathlib import Path
from typing import Any

import pytest

from distune.launcher import placement
from distune.launcher.level2 import trial_world
from distune.launcher.options import build_parser, options_from_args
from distune.launcher.plan import LaunchPlan, plan_launch, plan_trials

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "deploy" / "slurm" / "distune.sbatch"
NODES = ("gpu-node-001", "gpu-node-002")
JOB_ID = "4242"

SCONTROL = '''
"""scontrol stand-in: only `scontrol show hostnames LIST`, for a comma-separated LIST."""
import sys

if sys.argv[1:3] != ["show", "hostnames"] or len(sys.argv) != 4:
    sys.exit(f"scontrol stand-in: unsupported arguments {sys.argv[1:]}")
print("\\n".join(sys.argv[3].split(",")))
'''
RECORDER = '''
"""Stand-in that records its arguments and the token in its environment, and starts nothing."""
import json
import os
import sys

record = {"argv": sys.argv[1:], "token": os.environ.get("DISTUNE_SERVICE_TOKEN")}
with open(os.environ["RECORD"], "w") as handle:
    json.dump(record, handle)
'''


def tool(name: str) -> str:
    """The path of a lint tool: the venv's (make install puts it there), else PATH's."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed; `make install` installs it (dev extra)")
    return found


class Allocation:
    """A two-node allocation whose srun records the step and starts each node's task by hand."""

    def __init__(self, tmp_path: Path) -> None:
        self.root = tmp_path
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        for name, source in (("scontrol", SCONTROL), ("srun", RECORDER)):
            stand_in = bin_dir / name
            stand_in.write_text(f"#!{sys.executable}{source}")
            stand_in.chmod(0o755)
        self.tasks_bin = tmp_path / "tasks-bin"  # what each node's task finds on PATH
        self.tasks_bin.mkdir()
        launcher = self.tasks_bin / "distune-run"
        launcher.write_text(f"#!{sys.executable}{RECORDER}")
        launcher.chmod(0o755)
        environment = {**os.environ}
        environment.pop("DISTUNE_SERVICE_TOKEN", None)
        for name in [name for name in environment if name.startswith(("SLURM_", "DISTUNE_"))]:
            del environment[name]
        self.env = {
            **environment,
            "PATH": f"{bin_dir}{os.pathsep}{environment.get('PATH', '')}",
            "SLURM_JOB_ID": JOB_ID,
            "SLURM_JOB_NODELIST": ",".join(NODES),
            "SLURM_JOB_NUM_NODES": str(len(NODES)),
            "SLURM_NNODES": str(len(NODES)),
            "SLURM_SUBMIT_DIR": str(tmp_path),
        }

    def submit(self, *args: str, env: dict[str, str] | None = None) -> tuple[dict[str, Any], str]:
        """Run the batch script; the step srun was asked for, and the script's output."""
        record = self.root / "srun.json"
        result = subprocess.run(
            ["bash", str(SBATCH), *args],
            cwd=REPO,
            env={**self.env, "RECORD": str(record), **(env or {})},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, result.stdout + result.stderr
        return json.loads(record.read_text()), result.stdout

    def run_task(self, step: dict[str, Any], node: int) -> dict[str, Any]:
        """Start the step's command as srun would on ``node``; what its distune-run received."""
        options = list(takewhile(lambda word: word.startswith("--"), step["argv"]))
        command = step["argv"][len(options) :]
        assert options == ["--ntasks-per-node=1", "--kill-on-bad-exit=1"]
        record = self.root / f"node{node}.json"
        env = {
            **self.env,
            "PATH": f"{self.tasks_bin}{os.pathsep}{self.env['PATH']}",
            "DISTUNE_SERVICE_TOKEN": step["token"],  # srun hands the batch environment on
            "SLURM_NODEID": str(node),
            "SLURM_PROCID": str(node),
            "SLURM_LOCALID": "0",
            "RECORD": str(record),
        }
        subprocess.run(command, cwd=REPO, env=env, check=True, timeout=60)
        return json.loads(record.read_text())

    def plans(
        self, step: dict[str, Any], monkeypatch: pytest.MonkeyPatch
    ) -> list[tuple[Any, LaunchPlan]]:
        """Each node's parsed command line and launch plan, with the token it was given."""
        result = []
        for node in range(len(NODES)):
            task = self.run_task(step, node)
            assert task["token"] and task["token"] not in " ".join(task["argv"])
            monkeypatch.setenv("DISTUNE_SERVICE_TOKEN", task["token"])
            args = build_parser().parse_args(task["argv"])
            # Planned as that node: its host names (and their -ib interface's) are this machine's.
            own = {NODES[node], f"{NODES[node]}-ib"}
            monkeypatch.setattr(placement, "is_local_address", lambda host, own=own: host in own)
            result.append((args, plan_launch(args, options_from_args(args))))
        return result


@pytest.fixture
def allocation(tmp_path, monkeypatch) -> Allocation:
    monkeypatch.delenv("DISTUNE_SYNC_INTERVAL", raising=False)
    return Allocation(tmp_path)


def test_shellcheck_finds_nothing():
    result = subprocess.run(
        [tool("shellcheck"), "--shell=bash", str(SBATCH)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_batch_directives_ask_for_one_task_per_node():
    directives = dict(
        re.findall(r"^#SBATCH\s+--([\w-]+)(?:=(\S+))?", SBATCH.read_text(), re.MULTILINE)
    )
    assert directives["ntasks-per-node"] == "1"
    assert int(directives["nodes"]) >= 2
    assert "gpus-per-node" in directives


def test_every_node_runs_one_static_job_whose_first_host_runs_the_service(allocation, monkeypatch):
    step, output = allocation.submit()
    (node0, plan0), (node1, plan1) = allocation.plans(step, monkeypatch)
    results = allocation.root / f"distune-{JOB_ID}"
    for args in (node0, node1):
        assert (args.nnodes, args.nproc_per_node) == ("2", "gpu")
        # Static: the workers' master address is the first host as given, never a host name
        # that torch's c10d rendezvous looks up on one node (127.0.1.1 on many a cluster).
        assert (args.rdzv_backend, args.rdzv_endpoint) == ("static", "")
        assert (args.master_addr, args.master_port) == (NODES[0], 29400)
        assert args.autotune_level == 1
        assert (args.autotune_log_file, args.autotune_best_file) == (
            results / "autotune.csv",
            results / "best.json",
        )
        assert args.training_script == "examples/train_gpt.py"
        assert (REPO / args.training_script).is_file()
    # Node rank = SLURM node id: node 0, the first host, holds torch's store and the service.
    assert (node0.node_rank, node1.node_rank) == (0, 1)
    assert plan0.starts_service and not plan1.starts_service
    url = f"http://{NODES[0]}:29401"
    assert plan0.settings.service_url == plan1.settings.service_url == url
    assert plan0.service_args[:4] == ("--host", NODES[0], "--port", "29401")
    assert url in output


def test_the_token_is_made_once_for_the_job_or_taken_from_the_environment(allocation):
    made, _ = allocation.submit()
    again, _ = allocation.submit()
    assert len(made["token"]) >= 32 and made["token"] != again["token"]
    assert made["token"] not in " ".join(made["argv"])
    given, _ = allocation.submit(env={"DISTUNE_SERVICE_TOKEN": "shared-secret"})
    assert given["token"] == "shared-secret"


def test_arguments_and_settings_override_the_defaults(allocation, monkeypatch, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    step, _ = allocation.submit(
        "--nproc_per_node", "4", "--autotune_max_samples", "20",
        "examples/train_mlp.py", "--seconds", "5",
        env={
            "DISTUNE_RDZV_PORT": "31000",
            "DISTUNE_RDZV_HOST": "gpu-node-001-ib",
            "DISTUNE_RESULTS_DIR": str(elsewhere),
        },
    )  # fmt: skip
    (node0, plan0), (_, plan1) = allocation.plans(step, monkeypatch)
    assert node0.nproc_per_node == "4"
    assert options_from_args(node0).autotune_max_samples == 20
    assert (node0.training_script, node0.training_script_args) == (
        "examples/train_mlp.py",
        ["--seconds", "5"],
    )
    assert (node0.master_addr, node0.master_port) == ("gpu-node-001-ib", 31000)
    assert (
        plan0.settings.service_url == plan1.settings.service_url == "http://gpu-node-001-ib:31001"
    )
    assert node0.autotune_best_file == elsewhere / "best.json" and elsewhere.is_dir()


def test_level_2_runs_on_the_recipe_s_rendezvous(allocation, monkeypatch, tmp_path):
    # Level 2 coordinates its trials over static rendezvous only: the recipe must give it that.
    step, _ = allocation.submit(
        "--nproc_per_node", "2", "--autotune_level", "2",
        "--autotune_results_dir", str(tmp_path / "trials"), "examples/train_gpt.py", "--steps", "30",
    )  # fmt: skip
    for node in range(len(NODES)):
        task = allocation.run_task(step, node)
        monkeypatch.setenv("DISTUNE_SERVICE_TOKEN", task["token"])
        args = build_parser().parse_args(task["argv"])
        assert args.autotune_level == 2
        assert trial_world(args) == (2, 4)  # 2 nodes x 2 ranks, coordinated by node 0
        own = NODES[node]  # planned as that node: its host name is this machine's
        monkeypatch.setattr(placement, "is_local_address", lambda host, own=own: host == own)
        plan = plan_trials(args, options_from_args(args))
        assert plan.starts_service == (node == 0)
        assert plan.settings.service_url == f"http://{NODES[0]}:29401"
