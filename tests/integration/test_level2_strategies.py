"""``distune.prepare`` in real 2-rank gloo jobs: every strategy trains the same model, and the
device memory cap makes out-of-memory real on CPU.

This file is also the worker script (see ddp_launch). The configuration reaches ``prepare``
through the ``DISTUNE_*`` variables the launcher sets, set here in-process between runs.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from ddp_launch import run_scenarios, worker_main
from torch import nn
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.optim import ZeroRedundancyOptimizer

import distune
from distune.trial_settings import (
    ACCUMULATION,
    BF16,
    CHECKPOINTING,
    DEVICE_MEMORY,
    MICRO_BATCH,
    ZERO_STAGE,
)
from distune.worker_runtime.strategy import StrategyError, apply

pytestmark = pytest.mark.slow
SCENARIOS = {}
STEPS = 3
PER_RANK = 4  # samples per rank per optimizer step
STOCK_ZERO1 = "zero1 against torch's stock zero1"


def scenario(fn):
    SCENARIOS[fn.__name__] = fn
    return fn


class Block(nn.Module):
    """A residual MLP block: the model's repeated unit (FSDP's and checkpointing's)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(self.norm(x)))


class Net(nn.Module):
    def __init__(self, width: int = 32, depth: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(8, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.out = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def train(
    stage: int,
    checkpointing: bool,
    micro: int,
    bf16: bool = False,
    clip: float | None = None,
    scaler: type[torch.amp.GradScaler] | None = None,
    seed_per_rank: bool = False,
) -> list[float]:
    """Losses of STEPS optimizer steps on this rank's fixed data, under one configuration
    (then, where gradients are clipped to ``clip``, the norms ``run.clip_grad_norm_`` saw),
    stepped through a gradient scaler of class ``scaler`` if given. ``seed_per_rank`` builds
    each rank's model from a seed of its own (timm's ``random_seed(seed, rank)``), as DDP
    scripts may: rank 0's seed is 0, so the model trained is the one seed 0 builds."""
    os.environ.update(
        {
            BF16: str(int(bf16)),
            ZERO_STAGE: str(stage),
            CHECKPOINTING: str(int(checkpointing)),
            MICRO_BATCH: str(micro),
            ACCUMULATION: str(PER_RANK // micro),
        }
    )
    rank = torch.distributed.get_rank()
    torch.manual_seed(rank if seed_per_rank else 0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    name = f"net{stage}{micro}{'b' if bf16 else ''}"
    run = distune.prepare(model, optimizer, micro_batch_size=PER_RANK, name=name)
    assert (run.micro_batch_size, run.gradient_accumulation_steps) == (micro, PER_RANK // micro)
    assert run.bf16 == bf16
    data = torch.Generator().manual_seed(100 + rank)
    x, y = torch.randn(PER_RANK, 8, generator=data), torch.randn(PER_RANK, 1, generator=data)
    losses, norms = [], []
    scaling = scaler("cpu", init_scale=2.0**10) if scaler is not None else None
    for _ in range(STEPS):
        total = 0.0
        for i, (xs, ys) in enumerate(zip(x.split(micro), y.split(micro), strict=True)):
            with run.accumulate(i):
                loss = nn.functional.mse_loss(run.model(xs), ys) / run.gradient_accumulation_steps
                (scaling.scale(loss) if scaling is not None else loss).backward()
            total += loss.item()
        if clip is not None:
            norms.append(float(run.clip_grad_norm_(clip)))
        if scaling is not None:
            scaling.step(run.optimizer)
            scaling.update()
        else:
            run.optimizer.step()
        run.optimizer.zero_grad()
        losses.append(total)
    return losses + norms


@scenario
def strategies_train_the_same_model(out: Path) -> dict:
    configs = [
        (0, False, 4),
        (0, False, 1),
        (1, False, 2),
        (2, False, 4),
        (3, False, 2),
        (3, True, 1),
        (0, True, 4),
    ]
    losses: dict = {f"{s}/{c}/{m}": train(s, c, m) for s, c, m in configs}
    # Clipped well below the gradients' norm: a rank clipping its shard by its own part of the
    # norm (torch's clip_grad_norm_ under FSDP) would train another model.
    clipped = [(0, False, 4), (1, False, 2), (2, False, 4), (3, False, 2)]
    clipped_losses = {f"clip {s}/{c}/{m}": train(s, c, m, clip=0.01) for s, c, m in clipped}
    # Every rank's model from its own seed: each stage trains rank 0's, as DDP does.
    seeded = [(2, False, 4), (3, False, 2)]
    seeded_losses = {
        f"seeded per rank {s}/{c}/{m}": train(s, c, m, seed_per_rank=True) for s, c, m in seeded
    }
    return {
        **losses,
        **clipped_losses,
        **seeded_losses,
        STOCK_ZERO1: zero1_against_stock_zero1(),
    }


@scenario
def bf16_strategies_train_the_same_model(out: Path) -> dict:
    configs = [(0, False, 4), (0, False, 1), (1, False, 2), (2, False, 4), (3, False, 2)]
    losses = {f"{s}/{c}/{m}": train(s, c, m, bf16=True) for s, c, m in configs}
    return {**losses, "fp32": train(0, False, 4)}


@scenario
def gradient_scalers_under_sharded_stages(out: Path) -> dict:
    """torch's GradScaler under ddp and zero1; ShardedGradScaler under zero2 and zero3; then
    torch's GradScaler under zero2, which is refused."""
    results: dict = {
        "ddp GradScaler": train(0, False, 4, scaler=torch.amp.GradScaler),
        "zero1 GradScaler": train(1, False, 2, scaler=torch.amp.GradScaler),
        "zero2 ShardedGradScaler": train(2, False, 4, scaler=ShardedGradScaler),
        "zero3 ShardedGradScaler": train(3, False, 2, scaler=ShardedGradScaler),
    }
    try:
        train(2, False, 4, scaler=torch.amp.GradScaler)
    except StrategyError as error:
        results["zero2 GradScaler"] = str(error)
    return results


class NormedBlock(nn.Module):
    """A block with a batch norm: running statistics updated by every training forward."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.norm = nn.BatchNorm1d(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.norm(self.linear(x)))


@scenario
def checkpointing_keeps_batch_norm_statistics(out: Path) -> dict:
    """Each rank's batch norms' buffers (running mean and variance, batches tracked) after
    STEPS steps of a model of NormedBlocks, with and without checkpointing."""
    results = {}
    for stage, checkpointing in [(0, False), (0, True), (3, True)]:
        os.environ.update({ZERO_STAGE: str(stage), CHECKPOINTING: str(int(checkpointing)),
                           MICRO_BATCH: str(PER_RANK), ACCUMULATION: "1"})  # fmt: skip
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), *(NormedBlock(16) for _ in range(2)))
        norms = [m for m in model.modules() if isinstance(m, nn.BatchNorm1d)]
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        run = distune.prepare(
            model, optimizer, micro_batch_size=PER_RANK, name=f"bn{stage}{checkpointing}",
            blocks=(NormedBlock,),
        )  # fmt: skip
        data = torch.Generator().manual_seed(100 + torch.distributed.get_rank())
        for _ in range(STEPS):
            run.model(torch.randn(PER_RANK, 8, generator=data)).square().mean().backward()
            run.optimizer.step()
            run.optimizer.zero_grad()
        results[f"{stage}/{checkpointing}"] = [
            b.float().tolist() for norm in norms for b in norm.buffers()
        ]
    return results


def zero1_against_stock_zero1() -> dict[str, bool]:
    """Parameters after STEPS steps of distune's zero1 and of torch's ``ZeroRedundancyOptimizer``
    at its defaults over the same DDP: the construction may change how the shards travel,
    never the values."""
    rank = torch.distributed.get_rank()
    cpu = torch.device("cpu")

    def trained(stock: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        torch.manual_seed(0)
        model = Net()
        first = [p.detach().clone() for p in model.parameters()]
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        applied = apply(model, optimizer, 0 if stock else 1, False, cpu, name=f"z{int(stock)}")
        zero = (
            ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2)
            if stock
            else applied.optimizer
        )
        data = torch.Generator().manual_seed(100 + rank)
        for _ in range(STEPS):
            x, y = (
                torch.randn(PER_RANK, 8, generator=data),
                torch.randn(PER_RANK, 1, generator=data),
            )
            nn.functional.mse_loss(applied.model(x), y).backward()
            zero.step()
            zero.zero_grad()
        return first, [p.detach().clone() for p in model.parameters()]

    first, ours = trained(stock=False)
    _, stock = trained(stock=True)
    return {
        "equal": all(torch.equal(a, b) for a, b in zip(ours, stock, strict=True)),
        "trained": all(not torch.equal(a, b) for a, b in zip(ours, first, strict=True)),
    }


@scenario
def memory_cap_raises_out_of_memory(out: Path) -> dict:
    for setting in (BF16, ZERO_STAGE, CHECKPOINTING, MICRO_BATCH, ACCUMULATION):
        os.environ.pop(setting, None)  # what train() left: the launcher's defaults, as alone
    os.environ[DEVICE_MEMORY] = str(64 * 2**10)  # the model (~14 KiB) and a little more
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    run = distune.prepare(model, optimizer, micro_batch_size=4)
    small = run.model(torch.randn(4, 8)).sum()
    small.backward()
    fitted = run.memory.peak_bytes()
    try:
        run.model(torch.randn(4096, 8)).sum().backward()
    except torch.OutOfMemoryError as error:
        return {"fitted_peak": fitted, "oom": str(error)}
    return {"fitted_peak": fitted, "oom": None}


#: Every scenario, in one job (a process start is seconds); the memory cap's stays last, as it
#: leaves the cap set.
SCENARIO_ORDER = [
    "strategies_train_the_same_model",
    "bf16_strategies_train_the_same_model",
    "gradient_scalers_under_sharded_stages",
    "checkpointing_keeps_batch_norm_statistics",
    "memory_cap_raises_out_of_memory",
]


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> dict[str, list[Any]]:
    """Each scenario's results by rank, from one 2-rank job."""
    return run_scenarios(__file__, SCENARIO_ORDER, tmp_path_factory.mktemp("job"), timeout=240)


def test_every_strategy_gives_ddps_losses_at_the_same_global_batch(job):
    results = job["strategies_train_the_same_model"]
    for rank_result in results:
        # zero1's parameters are torch's stock zero1's, bit for bit, whatever its broadcast.
        assert rank_result.pop(STOCK_ZERO1) == {"equal": True, "trained": True}
        # Each rank's losses are on its own data: compare within the rank.
        for config, losses in rank_result.items():
            reference = rank_result["clip 0/False/4" if "clip" in config else "0/False/4"]
            torch.testing.assert_close(losses, reference, rtol=1e-5, atol=1e-6, msg=config)
    assert results[0]["clip 0/False/4"][:STEPS] != results[0]["0/False/4"]  # clipping bit
    job_loss = [sum(r["0/False/4"][step] for r in results) for step in range(STEPS)]
    assert job_loss[-1] < job_loss[0]  # it trains: the job's loss, whose gradient each rank steps


def test_bf16_strategies_give_bf16_ddps_losses_within_bf16_tolerance(job):
    results = job["bf16_strategies_train_the_same_model"]
    for rank_result in results:
        fp32 = rank_result.pop("fp32")
        reference = rank_result["0/False/4"]
        # bf16 keeps 8 bits of mantissa: a relative error of 2^-8 per rounding.
        for config, losses in rank_result.items():
            torch.testing.assert_close(losses, reference, rtol=3e-2, atol=1e-3, msg=config)
        assert reference != fp32  # mixed precision really ran: the numerics changed
        torch.testing.assert_close(reference, fp32, rtol=3e-2, atol=1e-3)


def test_a_gradient_scaler_that_checks_a_shard_alone_is_refused_under_zero2(job):
    results = job["gradient_scalers_under_sharded_stages"]
    for rank_result in results:
        refused = rank_result.pop("zero2 GradScaler")
        assert "torch.amp.GradScaler checks only its own rank's shard" in refused
        assert "Use torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler" in refused
        reference = rank_result["ddp GradScaler"]
        for config, losses in rank_result.items():
            torch.testing.assert_close(losses, reference, rtol=1e-5, atol=1e-6, msg=config)


def test_checkpointing_updates_batch_norm_statistics_once_a_forward(job):
    for rank, rank_result in enumerate(job["checkpointing_keeps_batch_norm_statistics"]):
        reference = rank_result.pop("0/False")
        tracked = [b for b in reference if not isinstance(b, list)]
        assert tracked == [STEPS, STEPS]  # one update a forward, in each of the two norms
        if rank > 0:
            # DDP copies rank 0's buffers before each forward, FSDP keeps each rank's own:
            # only rank 0's (those a checkpoint saves) are the same under both.
            del rank_result["3/True"]
        for config, buffers in rank_result.items():
            # The recomputation in backward used to update them again: 2 x STEPS tracked.
            torch.testing.assert_close(buffers, reference, rtol=1e-5, atol=1e-6, msg=config)


def test_the_memory_cap_raises_torchs_out_of_memory_error_on_cpu(job):
    results = job["memory_cap_raises_out_of_memory"]
    for result in results:
        assert 0 < result["fitted_peak"] <= 64 * 2**10
        assert "over the cap of 65536 bytes" in result["oom"]


if __name__ == "__main__":
    worker_main(SCENARIOS)
