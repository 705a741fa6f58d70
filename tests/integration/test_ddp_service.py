"""Tuning from inside a 2-rank job: sync points, the leader's HTTP thread, a dead service.

Every rank records, after each step, the iteration and the group in use: the ranks' records must
be identical (all switch at the same iteration), and so must the trained parameters.
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import requests
import torch
from ddp_launch import free_port, run_job, worker_main
from torch import nn

import distune

pytestmark = pytest.mark.slow
WARNING = "tuning service at"


def train(out: Path) -> dict:
    """``STEPS`` steps of a small MLP, a few milliseconds each; the record of every step."""
    steps = int(os.environ["TEST_STEPS"])
    if os.environ.get("TEST_UNTUNED_RANK") == os.environ["RANK"]:
        os.environ["DISTUNE_AUTOTUNE_LEVEL"] = "0"  # a node launched with other flags
    torch.manual_seed(0)
    # 4 * (32*256 + 256 + 256*256 + 256 + 256*8 + 8) bytes: a space of 2^16..2^19.
    model = distune.DistributedDataParallel(
        nn.Sequential(
            nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 8)
        )
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(int(os.environ["RANK"]))
    records = []
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(16, 32, generator=generator)).pow(2).mean().backward()
        optimizer.step()
        hp = model.hyperparameters
        records.append([model._reducer.iterations, hp.bucket_size_2p, hp.is_hierarchical_reduce])
        time.sleep(0.004)  # steps of a few ms: many sync points in a couple of seconds
    return {"records": records, "params": [p.detach().sum().item() for p in model.parameters()]}


def assert_lockstep(results: list[dict]) -> list[list]:
    """Identical records and parameters on every rank; returns rank 0's records."""
    first = results[0]
    for rank, result in enumerate(results[1:], 1):
        assert result["records"] == first["records"], f"rank {rank} switched at other iterations"
        assert result["params"] == first["params"], f"rank {rank} trained other parameters"
    return first["records"]


def switches(records: list[list]) -> list[list]:
    return [now for before, now in itertools.pairwise(records) if now[1:] != before[1:]]


def tuning_env(url: str, steps: int) -> dict[str, str]:
    return {
        "DISTUNE_AUTOTUNE_LEVEL": "1",
        "DISTUNE_SERVICE_URL": url,
        "DISTUNE_SYNC_INTERVAL": "0.1",
        "TEST_STEPS": str(steps),
    }


def test_unreachable_service_one_warning_and_training_goes_on(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    results = run_job(__file__, "train", tmp_path, env=tuning_env(url, 300))
    records = assert_lockstep(results)
    assert records[-1][0] == 300 and not switches(records)
    log = (tmp_path / "rank0.err").read_text()
    assert log.count(WARNING) == 1, log
    assert WARNING not in (tmp_path / "rank1.err").read_text()  # only the leader talks HTTP


def test_a_real_service_tunes_the_job_in_lockstep(quick_service, tmp_path):
    # Rank 1 is told not to tune (its node launched at --autotune_level 0): it follows rank 0.
    # Before, it skipped the sync points' collective and the ranks' collectives went out of
    # step: gloo timed out (or paired a sync point with a gradient bucket).
    url = quick_service.url
    env = {**tuning_env(url, 700), "TEST_UNTUNED_RANK": "1"}
    results = run_job(__file__, "train", tmp_path / "job", env=env, timeout=120)
    records = assert_lockstep(results)
    status = requests.get(f"{url}/api/v1/status", timeout=5).json()["models"]["model0"]
    assert status["samples"] >= 2, status
    assert switches(records), "the service's groups were never applied"
    assert (tmp_path / "job" / "rank0.err").read_text().count(WARNING) == 0
    assert (
        "this rank would not tune the model but rank 0 tunes it"
        in (tmp_path / "job" / "rank1.err").read_text()
    )


def kill_once_sampling(url: str, proc: subprocess.Popen[str], deadline: float) -> None:
    """SIGKILL the service as soon as it has finished a sample (the job is mid-tuning)."""
    while time.monotonic() < deadline:
        try:
            models = requests.get(f"{url}/api/v1/status", timeout=2).json()["models"]
            if models.get("model0", {}).get("samples", 0) >= 1:
                proc.kill()
                return
        except requests.RequestException:
            pass
        time.sleep(0.05)


def test_training_finishes_when_the_service_is_killed_mid_run(quick_service, tmp_path):
    url, proc = quick_service.url, quick_service.process
    killer = threading.Thread(target=kill_once_sampling, args=(url, proc, time.monotonic() + 60))
    killer.start()
    try:
        results = run_job(
            __file__, "train", tmp_path / "job", env=tuning_env(url, 800), timeout=120
        )
    finally:
        killer.join()
    assert proc.wait(timeout=5) == -signal.SIGKILL, "the job ended before the service was killed"
    quick_service.stop()  # collects what it printed
    assert "registered" in quick_service.output[1]
    records = assert_lockstep(results)
    assert records[-1][0] == 800
    assert (tmp_path / "job" / "rank0.err").read_text().count(WARNING) == 1


def subgroups(out: Path) -> dict:
    """Each rank is its own one-rank data-parallel group; both tune a model named ``net``."""
    import torch.distributed as dist

    groups = [dist.new_group([rank]) for rank in range(dist.get_world_size())]
    torch.manual_seed(0)
    model = distune.DistributedDataParallel(
        nn.Linear(32, 8), process_group=groups[dist.get_rank()], name="net"
    )
    for _ in range(int(os.environ["TEST_STEPS"])):
        model(torch.randn(4, 32)).sum().backward()
        time.sleep(0.004)
    return {}


def uneven(out: Path) -> dict:
    """Tuning while rank 1 has 40 batches more than rank 0, under ``model.join()``."""
    import torch.distributed as dist

    torch.manual_seed(0)
    model = distune.DistributedDataParallel(
        nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 8))
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(dist.get_rank())
    with model.join():
        for _ in range(int(os.environ["TEST_STEPS"]) + 40 * dist.get_rank()):
            optimizer.zero_grad()
            model(torch.randn(16, 32, generator=generator)).pow(2).mean().backward()
            optimizer.step()
            time.sleep(0.004)
    return {
        "iterations": model._reducer.iterations,
        "hyperparameters": model.hyperparameters.to_dict(),
        "params": [p.detach().sum().item() for p in model.parameters()],
    }


def test_uneven_inputs_under_join_keep_tuning_in_lockstep(quick_service, tmp_path):
    url = quick_service.url
    results = run_job(__file__, "uneven", tmp_path / "job", env=tuning_env(url, 80))
    # The joined rank 0 shadowed rank 1's last 40 iterations, sync points included.
    assert results[0] == results[1]
    assert results[0]["iterations"] == 120


def test_each_data_parallel_subgroup_has_its_own_tuning_session(quick_service, tmp_path):
    url = quick_service.url
    run_job(__file__, "subgroups", tmp_path / "job", env=tuning_env(url, 200))
    models = requests.get(f"{url}/api/v1/status", timeout=5).json()["models"]
    # One session per subgroup, named after its first global rank (docs/worker_runtime.md).
    assert set(models) == {"net.r0", "net.r1"}, models


def finetune(out: Path) -> dict:
    """Fine-tuning as docs/worker_runtime.md says: ``STEPS`` steps of the head on a frozen
    backbone, then the backbone unfrozen and the module wrapped again, ``STEPS`` more."""
    steps = int(os.environ["TEST_STEPS"])
    torch.manual_seed(0)
    module = nn.Sequential(
        nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 8)
    )
    module[:4].requires_grad_(False)
    generator = torch.Generator().manual_seed(int(os.environ["RANK"]))
    records = []
    for phase in ("head", "all"):
        if phase == "all":
            module.requires_grad_(True)
        model = distune.DistributedDataParallel(module)
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.01)
        for _ in range(steps):
            optimizer.zero_grad()
            model(torch.randn(16, 32, generator=generator)).pow(2).mean().backward()
            optimizer.step()
            hp = model.hyperparameters
            records.append(
                [phase, model._reducer.iterations, hp.bucket_size_2p, hp.is_hierarchical_reduce]
            )
            time.sleep(0.004)
    return {"records": records, "params": [p.detach().sum().item() for p in module.parameters()]}


def test_a_model_wrapped_again_after_unfreezing_is_tuned_again(quick_service, tmp_path):
    # Before, the second registration (more gradient bytes) got 409 and the unfrozen phase, the
    # one that matters most, trained untuned.
    url = quick_service.url
    results = run_job(__file__, "finetune", tmp_path / "job", env=tuning_env(url, 400))
    records = assert_lockstep(results)
    unfrozen = [record[1:] for record in records if record[0] == "all"]
    assert switches(unfrozen), "the unfrozen model's groups were never applied"
    model = requests.get(f"{url}/api/v1/status", timeout=5).json()["models"]["model0"]
    head_bytes = 4 * (256 * 8 + 8)
    assert model["registration"]["gradient_bytes"] == head_bytes + 4 * (32 * 256 + 256 * 257 + 256)
    assert model["samples"] >= 2, model
    [head] = model["earlier"]
    assert head["registration"]["gradient_bytes"] == head_bytes
    assert head["samples"] >= 1 and head["superseded_reports"] == 0, head
    log = requests.get(f"{url}/api/v1/models/model0/log", timeout=5).text.splitlines()
    assert len(log) >= 1 + head["samples"] + model["samples"], log
    assert (tmp_path / "job" / "rank0.err").read_text().count(WARNING) == 0


if __name__ == "__main__":
    worker_main({"train": train, "subgroups": subgroups, "uneven": uneven, "finetune": finetune})
