"""distune.DistributedDataParallel against torch's, in real multi-process gloo jobs.

Each test starts a job (this file is also the worker script) whose ranks train our wrapper and
torch's DDP side by side on the same model and data, and compare gradients after every backward
and parameters at the end. With 2 ranks the sums are exact, so the comparisons are tight.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from ddp_launch import run_job, run_scenarios, worker_main
from torch import nn
from torch.testing import assert_close

import distune
from distune import Hyperparameters

pytestmark = pytest.mark.slow
SCENARIOS = {}
STEPS = 4


def scenario(fn):
    SCENARIOS[fn.__name__] = fn
    return fn


def make_model(dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Module:
    """Six parameters of 20 B to 16 KiB (fp32). The 128x32 weight is large enough to be divided
    while copied into its bucket, the others are divided with their bucket: both paths, alone
    and mixed in one bucket."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 128), nn.Tanh(), nn.Linear(128, 5)
    ).to(dtype)


def batch(step: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * dist.get_rank() + step)
    return torch.randn(6, 12, generator=generator).to(dtype)


def loss_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).float().pow(2).mean()


def assert_grads_equal(ours: nn.Module, ref: nn.Module, what: str, **tolerance: Any) -> None:
    for (name, a), b in zip(ours.module.named_parameters(), ref.module.parameters(), strict=True):
        if a.grad is None or b.grad is None:
            assert a.grad is None and b.grad is None, f"{what}: {name} grad None on one side"
            continue
        assert_close(a.grad, b.grad, msg=lambda m, n=name: f"{what}: {n}: {m}", **tolerance)


def assert_params_equal(a: nn.Module, b: nn.Module, what: str, **tolerance: Any) -> None:
    for (name, x), y in zip(a.named_parameters(), b.parameters(), strict=True):
        assert_close(x, y, msg=lambda m, n=name: f"{what}: {n}: {m}", **tolerance)


def train_side_by_side(
    ours: nn.Module, ref: nn.Module, what: str, dtype: torch.dtype = torch.float32, **tol: Any
) -> None:
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ours, ref)]
    for step in range(STEPS):
        x = batch(step, dtype)
        for model, optimizer in zip((ours, ref), optimizers, strict=True):
            optimizer.zero_grad()
            loss_of(model, x).backward()
        assert_grads_equal(ours, ref, f"{what} step {step}", **tol)
        for optimizer in optimizers:
            optimizer.step()
    assert_params_equal(ours.module, ref.module, f"{what} after {STEPS} steps", **tol)


@scenario
def matches_torch_ddp(out: Path) -> dict:
    """Several bucket sizes x both allreduce shapes (hierarchical where the topology has it)."""
    rank = dist.get_rank()
    shapes = (False, True)
    buckets = {}
    for bucket_2p in (0, 11, 13, 15):
        for hierarchical in shapes:
            # Rank-dependent initial weights: construction must broadcast rank 0's.
            ours = distune.DistributedDataParallel(
                make_model(seed=rank), bucket_size=2**bucket_2p, hierarchical=hierarchical
            )
            ref = nn.parallel.DistributedDataParallel(make_model(seed=rank))
            expected = Hyperparameters(
                bucket_2p, hierarchical and ours.topology.hierarchical_possible
            )
            assert ours.hyperparameters == expected, ours.hyperparameters
            train_side_by_side(ours, ref, f"2^{bucket_2p} hierarchical={hierarchical}")
            buckets[f"{bucket_2p}/{hierarchical}"] = len(ours._reducer.bucket_sizes)
    return {
        "buckets": buckets,
        "nnodes": ours.topology.nnodes,
        "local_world_size": ours.topology.local_world_size,
    }


@scenario
def construction_broadcasts_buffers(out: Path) -> dict:
    module = make_model(seed=dist.get_rank())
    module.register_buffer("counter", torch.full((3,), float(dist.get_rank())))
    module.register_buffer("mask", torch.tensor([dist.get_rank() == 0, True]))
    ours = distune.DistributedDataParallel(module)
    assert_params_equal(ours.module, make_model(seed=0), "parameters")
    assert ours.module.counter.tolist() == [0.0] * 3
    assert ours.module.mask.tolist() == [True, True]
    torch_keys = list(nn.parallel.DistributedDataParallel(copy.deepcopy(module)).state_dict())
    assert list(ours.state_dict()) == torch_keys
    assert torch_keys[0].startswith("module.")
    return {}


@scenario
def half_precision(out: Path) -> dict:
    for dtype in (torch.float16, torch.bfloat16):
        ours = distune.DistributedDataParallel(make_model(dtype), bucket_size=2**10)
        ref = nn.parallel.DistributedDataParallel(make_model(dtype))
        assert ours._reducer._buckets[0].flat.dtype == dtype
        train_side_by_side(ours, ref, str(dtype), dtype)
    return {}


@scenario
def no_sync_accumulation(out: Path) -> dict:
    ours = distune.DistributedDataParallel(make_model(), bucket_size=2**11)
    ref = nn.parallel.DistributedDataParallel(make_model())
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (ours, ref)]
    for step in range(3):
        for model, optimizer in zip((ours, ref), optimizers, strict=True):
            optimizer.zero_grad()
            with model.no_sync():
                for micro in range(2):
                    loss_of(model, batch(10 * step + micro)).backward()
            # As with torch DDP, the forward decides: backward outside no_sync does not sync.
            with model.no_sync():
                loss = loss_of(model, batch(10 * step + 2))
            loss.backward()
        assert_grads_equal(ours, ref, f"local accumulation, step {step}")
        for model in (ours, ref):
            loss_of(model, batch(10 * step + 3)).backward()
        assert_grads_equal(ours, ref, f"accumulated and averaged, step {step}")
        for optimizer in optimizers:
            optimizer.step()
    assert_params_equal(ours.module, ref.module, "after no_sync training")
    return {}


class Branches(nn.Module):
    """``b`` is used on rank 1 only, ``c`` on no rank."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(12, 5)
        self.b = nn.Linear(12, 5)
        self.c = nn.Linear(12, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.a(x)
        return out + self.b(x) if dist.get_rank() == 1 else out


@scenario
def unused_parameters(out: Path) -> dict:
    ours = distune.DistributedDataParallel(Branches(), bucket_size=2**8)
    ref = nn.parallel.DistributedDataParallel(Branches(), find_unused_parameters=True)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.1) for m in (ours, ref)]
    for step in range(3):
        for model, optimizer in zip((ours, ref), optimizers, strict=True):
            optimizer.zero_grad()
            loss_of(model, batch(step)).backward()
        assert_grads_equal(ours, ref, f"step {step}")
        assert ours.module.b.weight.grad is not None, "b is used on rank 1: averaged everywhere"
        assert ours.module.c.weight.grad is None, "c is used nowhere: its grad stays None"
        for optimizer in optimizers:
            optimizer.step()
    assert_params_equal(ours.module, ref.module, "after training with unused parameters")
    return {}


SWITCHES = {
    1: Hyperparameters(0, False),
    2: Hyperparameters(15, True),
    4: Hyperparameters(9, True),
    5: Hyperparameters(11, False),
}


@scenario
def switches_change_nothing(out: Path) -> dict:
    """Parameters after training with switches (one inside no_sync accumulation) equal those
    of a run without switches; both equal torch DDP's."""
    models = [distune.DistributedDataParallel(make_model(), bucket_size=2**11) for _ in range(2)]
    models.append(nn.parallel.DistributedDataParallel(make_model()))
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in models]
    applied = []
    for step in range(7):
        switched = models[0]
        if step in SWITCHES:
            switched.set_hyperparameters(SWITCHES[step])
            applied.append([step, switched.hyperparameters.to_dict()])
        for model, optimizer in zip(models, optimizers, strict=True):
            optimizer.zero_grad()
            with model.no_sync():
                loss_of(model, batch(2 * step)).backward()
            if model is switched and step == 3:
                model.set_hyperparameters(Hyperparameters(10, False))  # mid-accumulation
            loss_of(model, batch(2 * step + 1)).backward()
        assert_grads_equal(models[0], models[1], f"switched vs not, step {step}")
        assert_grads_equal(models[0], models[2], f"switched vs torch, step {step}")
        for optimizer in optimizers:
            optimizer.step()
    assert_params_equal(models[0].module, models[1].module, "with and without switches")
    return {"applied": applied}


@scenario
def two_nodes(out: Path) -> dict:
    """The hierarchical job runs both checks in one launch (4 processes start slowly here)."""
    return {**matches_torch_ddp(out), **switches_change_nothing(out)}


#: The scenarios of one node of two ranks: one job runs them all (a process start is seconds).
ONE_NODE = [
    "matches_torch_ddp",
    "construction_broadcasts_buffers",
    "half_precision",
    "no_sync_accumulation",
    "unused_parameters",
    "switches_change_nothing",
]


@pytest.fixture(scope="module")
def one_node(tmp_path_factory) -> dict[str, list[Any]]:
    """Each of ``ONE_NODE``'s results by rank, from one 2-rank job."""
    return run_scenarios(__file__, ONE_NODE, tmp_path_factory.mktemp("one_node"), timeout=150)


def test_gradients_match_torch_ddp_for_several_bucket_sizes(one_node):
    results = one_node["matches_torch_ddp"]
    buckets = results[0]["buckets"]
    # 2^0: a bucket per parameter ... 2^15: one bucket (see test_worker_buckets for the rule).
    assert [buckets[f"{p}/False"] for p in (0, 11, 13, 15)] == [6, 4, 2, 1]
    assert results[0]["nnodes"] == 1


def test_two_nodes_of_two_ranks_hierarchical_and_flat_match_torch_ddp_and_switch(tmp_path):
    """2 simulated nodes x 2 ranks: both shapes match torch DDP, and switching between flat and
    hierarchical mid-run (also mid-accumulation) changes no parameter."""
    results = run_job(__file__, "two_nodes", tmp_path, nodes=2, per_node=2, timeout=150)
    assert all((r["nnodes"], r["local_world_size"]) == (2, 2) for r in results)
    assert all(r["applied"] == results[0]["applied"] for r in results)
    assert len(results[0]["applied"]) == len(SWITCHES)


# The scenarios below assert inside the ranks (a failure fails the job): each test is its own
# scenario's verdict.
def test_construction_broadcasts_parameters_and_buffers(one_node):
    assert one_node["construction_broadcasts_buffers"] == [{}, {}]


def test_fp16_and_bf16_parameters(one_node):
    assert one_node["half_precision"] == [{}, {}]


def test_no_sync_accumulation_equals_torch_ddp(one_node):
    assert one_node["no_sync_accumulation"] == [{}, {}]


def test_unused_parameters_handled_like_find_unused_parameters(one_node):
    assert one_node["unused_parameters"] == [{}, {}]


def test_switches_leave_training_unchanged(one_node):
    results = one_node["switches_change_nothing"]
    assert results[0]["applied"] == results[1]["applied"]
    assert len(results[0]["applied"]) == len(SWITCHES)


if __name__ == "__main__":
    worker_main(SCENARIOS)
