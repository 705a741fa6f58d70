"""deploy/slurm/distune.sbatch on a fake two-node allocation on this machine.

SLURM is not here, so the test runs the batch script itself (as sbatch would, on the first
node) with the SLURM variables it reads set for a two-node allocation on loopback, and puts two
stand-ins first on PATH: ``scontrol show hostnames`` lists the fake nodes, and ``srun`` starts
its command once per fake node with that task's SLURM variables, as srun starts one task per
node. Everything else (the script's logic, both launchers, the rendezvous, the service, the
workers) is real.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import re
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from distune.space import Hyperparameters
from tests.support.launcher_process import MARKER, processes_with
from tests.support.local_host import free_port_pair, port_is_free

from .conftest import REPO

pytestmark = pytest.mark.slow

SBATCH = REPO / "deploy" / "slurm" / "distune.sbatch"
JOB_ID = "4242"
NODES = ("127.0.0.1", "127.0.0.2")
# A small MLP trained long enough for warm-up plus two one-second samples.
TRAIN = [
    "examples/train_mlp.py", "--width", "256", "--depth", "3", "--log-every", "0.5",
]  # fmt: skip
FAST_TUNING = [
    "--nproc_per_node", "1",
    "--autotune_warmup_time", "1",
    "--autotune_sampling_confidence_time", "1",
    # Two samples: a third would be a close call, whose legs (40 samples' time) outlast the job.
    "--autotune_max_samples", "2",
]  # fmt: skip

SCONTROL = '''
"""scontrol stand-in: only `scontrol show hostnames LIST`, for a comma-separated LIST."""
import sys

if sys.argv[1:3] != ["show", "hostnames"] or len(sys.argv) != 4:
    sys.exit(f"scontrol stand-in: unsupported arguments {sys.argv[1:]}")
print("\\n".join(sys.argv[3].split(",")))
'''

SRUN = '''
"""srun stand-in: one task per node of the allocation, each with its own SLURM_NODEID."""
import os
import subprocess
import sys
import time

args = sys.argv[1:]
options = {}
while args and args[0].startswith("--"):
    name, _, value = args.pop(0)[2:].partition("=")
    options[name] = value
if options != {"ntasks-per-node": "1", "kill-on-bad-exit": "1"}:
    sys.exit(f"srun stand-in: unsupported options {options}")
nodes = int(os.environ["SLURM_JOB_NUM_NODES"])
tasks = [
    subprocess.Popen(
        args,
        env={
            **os.environ,
            "SLURM_NODEID": str(node),
            "SLURM_PROCID": str(node),
            "SLURM_LOCALID": "0",
            "SLURM_STEP_ID": "0",
        },
    )
    for node in range(nodes)
]
# --kill-on-bad-exit=1: a task that fails takes the step down.
while any(task.poll() is None for task in tasks):
    if any(task.returncode not in (None, 0) for task in tasks):
        for task in tasks:
            if task.poll() is None:
                task.terminate()
    time.sleep(0.1)
sys.exit(next((task.returncode for task in tasks if task.returncode), 0))
'''


class FakeAllocation:
    """A two-node SLURM allocation on loopback, with the stand-ins first on PATH."""

    def __init__(self, tmp_path: Path) -> None:
        self.submit_dir = tmp_path
        self.marker = uuid.uuid4().hex
        self.rdzv_port = free_port_pair()
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        for name, source in (("scontrol", SCONTROL), ("srun", SRUN)):
            tool = bin_dir / name
            tool.write_text(f"#!{sys.executable}{source}")
            tool.chmod(0o755)
        environment = {**os.environ}
        environment.pop("DISTUNE_SERVICE_TOKEN", None)  # the script makes one for the job
        self.env = {
            **environment,
            "PATH": os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent)])
            + os.pathsep
            + environment.get("PATH", ""),
            MARKER: self.marker,
            "SLURM_JOB_NODELIST": ",".join(NODES),
            "SLURM_JOB_NUM_NODES": str(len(NODES)),
            "SLURM_NNODES": str(len(NODES)),
            "SLURM_SUBMIT_DIR": str(tmp_path),
            "DISTUNE_RDZV_PORT": str(self.rdzv_port),
            "DISTUNE_SYNC_INTERVAL": "0.25",
            "GLOO_SOCKET_IFNAME": "lo",  # keep the fake nodes' traffic on loopback
        }

    def results(self, job_id: str) -> Path:
        """Where the script puts a job's log and best-file by default."""
        return self.submit_dir / f"distune-{job_id}"

    def sbatch(self, job_id: str, args: list[str], timeout: float) -> tuple[int, str]:
        """Run the batch script as sbatch would on the first node; its exit code and output."""
        process = subprocess.Popen(
            ["bash", str(SBATCH), *args],
            cwd=REPO,
            env={**self.env, "SLURM_JOB_ID": job_id},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            output, _ = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill_all()
            output, _ = process.communicate()
            pytest.fail(f"the batch script did not finish in {timeout} s:\n{output}")
        return process.returncode, output

    def kill_all(self) -> None:
        """SIGKILL whatever this allocation still runs."""
        for pid in processes_with(self.marker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def started_services(output: str) -> list[str]:
    """The URLs of the tuning services the launchers started (each prints one line)."""
    return re.findall(r"^distune: tuning service at (\S+)", output, re.MULTILINE)


@pytest.fixture
def allocation(tmp_path):
    fake = FakeAllocation(tmp_path)
    yield fake
    fake.kill_all()


def test_two_fake_nodes_form_one_tuned_job_and_its_best_file_fixes_the_next(allocation):
    service_port = allocation.rdzv_port + 1
    code, output = allocation.sbatch(JOB_ID, [*FAST_TUNING, *TRAIN, "--seconds", "15"], 240)
    assert code == 0, output

    # One job: a single service, on the first host at rendezvous port + 1.
    assert started_services(output) == [f"http://127.0.0.1:{service_port}"], output
    assert "distune: model mlp: completed" in output, output
    results = allocation.results(JOB_ID)
    with (results / "autotune.csv").open() as handle:
        reader = csv.reader(handle)
        header = next(reader)
        rows = list(reader)
    assert header[:4] == ["bucket_size_2p", "is_hierarchical_reduce", "score", "train_iter"]
    assert len(rows) >= 3, rows
    best = json.loads((results / "best.json").read_text())
    chosen = Hyperparameters.from_dict(
        best["autotune_result"]["models"]["mlp"]["group"]["hyperparameters"]
    )
    assert best["bucket_size"] == chosen.bucket_size
    assert best["hierarchical_reduce"] is False  # one process per node: nothing to split
    assert f"--autotune_config {results / 'best.json'}" in output
    assert processes_with(allocation.marker) == []
    assert port_is_free(service_port)

    # The next job reuses the best-file: every knob fixed, so no service, and the chosen group.
    code, output = allocation.sbatch(
        "4243",
        [*FAST_TUNING, "--autotune_config", str(results / "best.json"), *TRAIN, "--seconds", "4"],
        120,
    )
    assert code == 0, output
    assert started_services(output) == [], output
    progress = [line for line in output.splitlines() if line.startswith("step ")]
    assert progress, output
    assert all(line.endswith(f"({chosen.describe()})") for line in progress), progress
    assert processes_with(allocation.marker) == []
