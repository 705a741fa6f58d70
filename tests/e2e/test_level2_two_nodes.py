"""Level 2 on two nodes: two ``distune-run`` launchers on one machine (static rendezvous on
loopback) run every trial together, coordinated by node 0's tuning service."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import requests

from tests.e2e.conftest import SCRIPTS
from tests.support.local_host import free_port_pair, port_is_free

pytestmark = pytest.mark.slow
WORKER = str(SCRIPTS / "level2_worker.py")
TOKEN = "level2-two-nodes"


def two_nodes(launch, results: Path, flags: list[str], worker_args: list[str]):
    """Node 0 and node 1 of one job, one rank each (rank 1 is node 1's)."""
    port = free_port_pair()
    common = [
        "--nnodes", "2", "--nproc_per_node", "1", "--rdzv_backend", "static",
        "--master_addr", "127.0.0.1", "--master_port", str(port),
        "--autotune_level", "2", "--autotune_results_dir", str(results),
        "--autotune_device_memory", "48MiB", *flags,
    ]  # fmt: skip
    env = {"DISTUNE_SERVICE_TOKEN": TOKEN}
    node0 = launch([*common, "--node_rank", "0", WORKER, *worker_args], env)
    node1 = launch([*common, "--node_rank", "1", WORKER, *worker_args], env)
    return port, node0, node1


def trials(results: Path) -> list[dict]:
    return [json.loads(line) for line in (results / "trials.jsonl").read_text().splitlines()]


def test_two_nodes_run_every_trial_together_and_train_with_the_winner(launch, tmp_path):
    results = tmp_path / "results"
    port, node0, node1 = two_nodes(
        launch,
        results,
        ["--autotune_max_trials", "2", "--autotune_trial_timeout", "60"],
        ["--batch-size", "4", "--grad-accum", "2"],
    )
    assert node0.service_url() == f"http://127.0.0.1:{port + 1}"
    assert node0.wait(timeout=240) == 0, node0.output
    assert node1.wait(timeout=60) == 0, node1.output
    ran = trials(results)
    # The profile (the script's own 4 x 2), then one search trial (the budget is 2: too small
    # to re-measure two configurations, and re-measuring one chooses nothing).
    assert [(t["purpose"], t["outcome"]) for t in ran] == [("profile", "ok"), ("search", "ok")]
    # The global batch counts both nodes' ranks: 2 ranks x micro-batch x accumulation.
    assert {t["config"]["train_batch_size"] for t in ran} == {16}
    # Rank 0 measured every rank's steps: one throughput for the whole two-node job.
    assert all(t["throughput"] > 0 and t["peak_memory_bytes"] > 0 for t in ran)
    assert "trials on 2 nodes" in node0.output
    # Node 1 ran its own ranks of every trial, in a directory of its own.
    assert sorted(p.name for p in (results / "node-1").iterdir()) == ["trial-000", "trial-001"]
    assert "node 1: node 0 chose trial" in node1.output
    # Run mode: both nodes train with the winner (rank 0, on node 0, prints it).
    # (a trial's output goes to its log, the run's to the terminal).
    best = json.loads((results / "best_config.json").read_text())
    chosen = (
        f"config: ddp {best['train_micro_batch_size_per_gpu']} x "
        f"{best['gradient_accumulation_steps']}"
    )
    assert node0.output.count(chosen) == 1, node0.output
    assert node0.leftovers() == [] and node1.leftovers() == []
    assert port_is_free(port + 1)


def test_a_rank_killed_on_node_1_ends_the_trial_on_both_nodes(launch, tmp_path):
    results = tmp_path / "results"
    port, node0, node1 = two_nodes(
        launch, results, ["--autotune_trial_timeout", "120", "--autotune_mode", "tune"], ["--hang"]
    )
    pid_file = results / "node-1" / "trial-000" / "pid.1"
    deadline = time.monotonic() + 90
    while not pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.2)  # until node 1's rank is in its training loop
    assert pid_file.exists(), node1.output
    killed = time.monotonic()
    os.kill(int(pid_file.read_text()), signal.SIGKILL)
    # Far sooner than the 120 s watchdog: node 0 learns of node 1's failure from the service.
    assert node0.wait(timeout=60) == 1, node0.output
    assert node1.wait(timeout=30) == 1, node1.output
    assert time.monotonic() - killed < 45
    (trial,) = trials(results)
    assert trial["outcome"] != "ok"
    assert trial["error"].startswith("node 1: "), trial
    assert node0.leftovers() == [] and node1.leftovers() == []
    assert port_is_free(port + 1)
    with pytest.raises(requests.ConnectionError):
        requests.get(f"http://127.0.0.1:{port + 1}/api/v1/health", timeout=2)


def test_ctrl_c_on_node_1_stops_the_trial_on_both_nodes_and_leaves_nothing(launch, tmp_path):
    results = tmp_path / "results"
    port, node0, node1 = two_nodes(
        launch, results, ["--autotune_trial_timeout", "120", "--autotune_mode", "tune"], ["--hang"]
    )
    ranks = [results / "trials" / "trial-000" / "pid.0", results / "node-1" / "trial-000" / "pid.1"]
    deadline = time.monotonic() + 90
    while not all(p.exists() for p in ranks) and time.monotonic() < deadline:
        time.sleep(0.2)  # until both nodes' ranks are in their training loop
    assert all(p.exists() for p in ranks), node0.output + node1.output
    node1.process.send_signal(signal.SIGINT)
    assert node1.wait(timeout=60) == 128 + signal.SIGINT, node1.output
    assert node0.wait(timeout=60) == 1, node0.output
    assert "node 1 stopped the trials (SIGINT)" in node0.output
    assert node0.leftovers() == [] and node1.leftovers() == []
    assert port_is_free(port + 1)
