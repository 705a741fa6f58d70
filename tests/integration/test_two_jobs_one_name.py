"""Two 2-rank jobs pointed at one tuning service, each wrapping a model of its own under the
default name ``model0``: the later registration (other facts) is tuned afresh, the earlier job is
told so once and trains on untuned, nothing of the two is merged and neither hangs
(docs/tuning_service.md, "Re-registration")."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import requests
import torch
from ddp_launch import run_job, worker_main
from test_ddp_service import WARNING, assert_lockstep, tuning_env
from torch import nn

import distune

pytestmark = pytest.mark.slow


def _train(model: nn.Module, going: Callable[[int], bool]) -> dict:
    """Train ``model`` while ``going(steps done)``; every step's iteration and group."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    records = []
    while going(len(records)):
        optimizer.zero_grad()
        model(torch.randn(16, 32)).pow(2).mean().backward()
        optimizer.step()
        hp = model.hyperparameters
        records.append([model._reducer.iterations, hp.bucket_size_2p, hp.is_hierarchical_reduce])
        time.sleep(0.004)
    return {"records": records, "params": [p.detach().sum().item() for p in model.parameters()]}


def first(out: Path) -> dict:
    """``train``'s model, trained until the test says stop (the ranks agree on the step)."""
    import torch.distributed as dist

    torch.manual_seed(0)
    model = distune.DistributedDataParallel(
        nn.Sequential(
            nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 8)
        )
    )
    stop = torch.zeros(1)

    def going(steps: int) -> bool:
        stop.fill_(float((out / "stop").exists() or steps >= 20_000))
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        return not stop.item()

    return _train(model, going)


def other(out: Path) -> dict:
    """Another model under the default name: 4 * (32*1024 + 1024 + 1024*8 + 8) gradient bytes,
    a space of 2^16..2^18 (the first job's is 2^16..2^19)."""
    torch.manual_seed(1)
    model = distune.DistributedDataParallel(
        nn.Sequential(nn.Linear(32, 1024), nn.ReLU(), nn.Linear(1024, 8))
    )
    steps = int(os.environ["TEST_STEPS"])
    return _train(model, lambda done: done < steps)


def test_a_second_job_under_the_same_name_is_tuned_and_the_first_told(quick_service, tmp_path):
    url = quick_service.url
    earlier: dict[str, list] = {}
    job = threading.Thread(
        target=lambda: earlier.update(
            results=run_job(__file__, "first", tmp_path / "first", env=tuning_env(url, 0))
        )
    )
    job.start()
    deadline = time.monotonic() + 60
    while "model0" not in requests.get(f"{url}/api/v1/status", timeout=5).json()["models"]:
        assert time.monotonic() < deadline and job.is_alive(), "the first job never registered"
        time.sleep(0.1)
    try:
        second = run_job(__file__, "other", tmp_path / "second", env=tuning_env(url, 400))
    finally:
        (tmp_path / "first" / "stop").touch()  # the first job still trains: it may end now
        job.join(120)
    assert not job.is_alive() and "results" in earlier, "the first job did not finish"
    assert_lockstep(earlier["results"])
    assert_lockstep(second)
    model = requests.get(f"{url}/api/v1/status", timeout=5).json()["models"]["model0"]
    second_bytes = 4 * (32 * 1024 + 1024 + 1024 * 8 + 8)
    assert model["registration"]["gradient_bytes"] == second_bytes
    assert model["samples"] >= 1, model
    [replaced] = model["earlier"]
    train_bytes = 4 * (32 * 256 + 256 + 256 * 256 + 256 + 256 * 8 + 8)
    assert replaced["registration"]["gradient_bytes"] == train_bytes
    assert replaced["superseded_reports"] >= 1, "the first job never reported again"
    told = (tmp_path / "first" / "rank0.err").read_text()
    assert told.count(WARNING) == 1 and "no longer tunes model 'model0'" in told, told
    assert WARNING not in (tmp_path / "second" / "rank0.err").read_text()


if __name__ == "__main__":
    worker_main({"first": first, "other": other})
