"""distune.algorithms in real 2-rank gloo jobs: each algorithm's math, checked exactly.

This file is also the worker script (see ddp_launch). Each job runs several checks, to keep the
number of process starts (and the suite's time) small.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from ddp_launch import run_job, run_scenarios, worker_main
from torch import nn

from distune.algorithms import AsyncModelAverage, Decentralized, GradientAllReduce, LowPrecision
from distune.worker_runtime.buckets import Bucket

pytestmark = pytest.mark.slow
SCENARIOS = {}


def scenario(fn):
    SCENARIOS[fn.__name__] = fn
    return fn


def _gather(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return out


def _bucket(numel: int) -> Bucket:
    # Two "parameters" whose gradients the bucket holds, as the engine builds them.
    return Bucket([torch.zeros(numel - 5), torch.zeros(5)])


class _Engine:
    """Drives an algorithm's exchange as the reducer does, one bucket per backward: divided by
    the world size first (unless the exchange averages itself), used flags set, start(flat)
    then finish."""

    def __init__(self, algorithm: LowPrecision) -> None:
        self.buckets: list[Bucket] = []
        self.exchange = algorithm.gradient_exchange(dist.group.WORLD, lambda: self.buckets)

    def average(self, bucket: Bucket, grads: torch.Tensor) -> torch.Tensor:
        self.buckets = [bucket]
        bucket.grads.copy_(grads / dist.get_world_size())
        bucket.flags.fill_(1)
        self.exchange.finish([self.exchange.start(bucket.flat)])
        assert bucket.flags.tolist() == [dist.get_world_size()] * len(bucket.flags)
        return bucket.grads.clone()


def _rounding_bound(inputs: list[torch.Tensor], mean: torch.Tensor, n: int) -> torch.Tensor:
    """Per element: half an 8-bit step of each rank's chunk (what it sends, pre-divided) plus
    half a step of the reduced chunk (what comes back): one quantization step in all."""
    padded = -(-mean.numel() // n) * n

    def half_steps(t: torch.Tensor) -> torch.Tensor:
        chunks = torch.nn.functional.pad(t, (0, padded - t.numel())).view(n, -1)
        steps = (chunks.amax(1) - chunks.amin(1)) / 255 / 2
        return steps[:, None].expand_as(chunks).reshape(-1)[: t.numel()]

    return sum(half_steps(x / n) for x in inputs) + half_steps(mean)


@scenario
def low_precision(out: Path) -> dict[str, Any]:
    n, rank = dist.get_world_size(), dist.get_rank()
    numel = 1000 + 3  # not a multiple of the world size: the last chunk is padded
    result: dict[str, Any] = {}

    # Without error feedback, one step: within one quantization step of the exact mean.
    engine = _Engine(LowPrecision(bits=8, error_feedback=False))
    worst = 0.0
    for step, size in enumerate([numel, numel, 10 * numel]):  # the last: 3 blocks a rank
        bucket = _bucket(size)
        grads = torch.randn(size, generator=torch.Generator().manual_seed(10 * step + rank))
        inputs = _gather(grads)
        mean = sum(inputs) / n
        averaged = engine.average(bucket, grads)
        bound = _rounding_bound(inputs, mean, n)
        error = (averaged - mean).abs()
        assert bool((error <= bound * (1 + 1e-4) + 1e-7).all()), (error - bound).max()
        worst = max(worst, float((error / bound).max()))
        # Every rank decodes the same bytes: identical averages everywhere.
        assert all(torch.equal(averaged, other) for other in _gather(averaged))
    result["no_feedback_worst_error_over_bound"] = worst

    # With error feedback: over k steps the sum of the averages is the exact sum within one
    # step; without it, a gradient that repeats loses the same rounding every step.
    k = 20
    grads = torch.randn(numel, generator=torch.Generator().manual_seed(99 + rank))
    inputs = _gather(grads)
    mean = sum(inputs) / n
    bound = _rounding_bound(inputs, mean, n)
    for feedback in (True, False):
        engine = _Engine(LowPrecision(bits=8, error_feedback=feedback))
        bucket = _bucket(numel)
        total = sum(engine.average(bucket, grads) for _ in range(k))
        drift = float(((total - k * mean).abs() / bound).max())
        result[f"sum_of_{k}_steps_error_over_bound_feedback_{feedback}"] = drift
    # The residual bounds of the last step use its own inputs (gradient plus carried error), a
    # little wider than the gradient's: 1.1 leaves room for that.
    assert result[f"sum_of_{k}_steps_error_over_bound_feedback_True"] <= 1.1
    assert result[f"sum_of_{k}_steps_error_over_bound_feedback_False"] > 3

    # 16-bit floats: the average within fp16/bf16 rounding, identical on every rank.
    for dtype, tolerance in (("fp16", 2e-3), ("bf16", 2e-2)):
        engine = _Engine(LowPrecision(bits=16, dtype=dtype))
        grads = torch.randn(numel, generator=torch.Generator().manual_seed(7 + rank))
        mean = sum(_gather(grads)) / n
        averaged = engine.average(_bucket(numel), grads)
        torch.testing.assert_close(averaged, mean, rtol=tolerance, atol=tolerance)
        assert all(torch.equal(averaged, other) for other in _gather(averaged))
    return result


def _model(rank: int) -> nn.Module:
    torch.manual_seed(rank)  # different weights on each rank: averaging has work to do
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).double()


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def decentralized(out: Path) -> dict[str, Any]:
    rank = dist.get_rank()
    for selection in ("ring", "shift_one"):
        model = _model(rank)
        averager = Decentralized(peer_selection=selection, interval=2).model_averager(
            list(model.parameters()), dist.group.WORLD
        )
        before = _gather(_flat(model))  # every rank's weights (2 ranks: each is the other's peer)
        expected = (before[0] + before[1]) / 2  # summed in rank order, as the averager does
        averager.before_forward()  # step 0: exchange starts, overlapping this step
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(0.125 * (rank + 1))  # this rank's own update of step 0
        averager.before_forward()  # step 1: applies step 0's exchange; no exchange (interval 2)
        local = torch.full_like(expected, 0.125 * (rank + 1))
        torch.testing.assert_close(_flat(model), expected - local, rtol=0, atol=1e-12)
        # Without a local update in between, the model is exactly the peers' average.
        now = _gather(_flat(model))
        averager.before_forward()  # step 2: nothing pending (no exchange at step 1); starts one
        averager.finish()  # applies it
        assert torch.equal(_flat(model), (now[0] + now[1]) / 2)
        assert torch.equal(*_gather(_flat(model)))
    return {}


def async_model_average(out: Path) -> dict[str, Any]:
    rank = dist.get_rank()
    model = _model(rank)
    averager = AsyncModelAverage(interval_seconds=0.01).model_averager(
        list(model.parameters()), dist.group.WORLD
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(rank)
    steps = 5 if rank == 0 else 40  # ranks stop at different steps
    start = time.monotonic()
    for _ in range(steps):
        averager.before_forward()
        x = torch.randn(8, 4, generator=generator, dtype=torch.float64)
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()
        time.sleep(0.005)
    averager.finish()  # rank 0 gets here long before rank 1: it must wait, not hang or leave
    elapsed = time.monotonic() - start
    weights = _gather(_flat(model))
    assert torch.equal(weights[0], weights[1]), "models differ after finish()"
    with pytest.raises(RuntimeError, match="finish"):
        averager.before_forward()
    return {"elapsed": elapsed, "rounds": averager.rounds}


def _batch(step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * dist.get_rank() + step)
    return torch.randn(6, 12, generator=generator)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(12, 64), nn.Tanh(), nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 3)
    )


@scenario
def comm_hooks(out: Path) -> dict[str, Any]:
    """torch's fp16 compression and PowerSGD hooks: distune's engine against torch DDP."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    import distune

    hooks = {
        "fp16": (lambda: None, default_hooks.fp16_compress_hook),
        "powersgd": (
            lambda: powersgd.PowerSGDState(
                process_group=None,
                matrix_approximation_rank=2,
                start_powerSGD_iter=2,
                min_compression_rate=0.5,
            ),
            powersgd.powerSGD_hook,
        ),
    }
    for name, (make_state, hook) in hooks.items():
        ours = distune.DistributedDataParallel(_mlp())
        ref = nn.parallel.DistributedDataParallel(_mlp())
        ours.register_comm_hook(make_state(), hook)
        ref.register_comm_hook(make_state(), hook)
        optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, ref)]
        for step in range(6):  # PowerSGD compresses from step 2 on
            for model, optimizer in zip((ours, ref), optimizers, strict=True):
                optimizer.zero_grad()
                model(_batch(step)).pow(2).mean().backward()
            for (pname, a), b in zip(
                ours.module.named_parameters(), ref.module.parameters(), strict=True
            ):
                torch.testing.assert_close(
                    a.grad, b.grad, rtol=1e-5, atol=1e-6, msg=f"{name} step {step} {pname}"
                )
            for optimizer in optimizers:
                optimizer.step()
    return {}


@scenario
def through_the_wrapper(out: Path) -> dict[str, Any]:
    """Each algorithm through DistributedDataParallel(..., algorithm=...)."""
    import distune

    results = {}
    # GradientAllReduce, named explicitly: torch DDP's gradients (2 ranks: exact sums).
    ours = distune.DistributedDataParallel(_mlp(), algorithm=GradientAllReduce())
    ref = nn.parallel.DistributedDataParallel(_mlp())
    for step in range(2):
        for model in (ours, ref):
            model.zero_grad()
            model(_batch(step)).pow(2).mean().backward()
        for a, b in zip(ours.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-7)
    # The fused optimizer on the wrapper: the same training as unfused, gradients averaged.
    models = [distune.DistributedDataParallel(_mlp()) for _ in range(2)]
    optimizers = [
        torch.optim.AdamW(models[0].parameters(), lr=0.01),
        distune.fuse_optimizer(torch.optim.AdamW(models[1].parameters(), lr=0.01)),
    ]
    for step in range(4):
        for model, optimizer in zip(models, optimizers, strict=True):
            optimizer.zero_grad(set_to_none=step % 2 == 0)
            model(_batch(step)).pow(2).mean().backward()
            optimizer.step()
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert torch.equal(*_gather(b.detach().contiguous()))
    # LowPrecision: every rank decodes the same bytes, so the models stay identical; the
    # averaged gradient is within 8-bit rounding of torch DDP's.
    ours = distune.DistributedDataParallel(_mlp(), algorithm=LowPrecision(bits=8))
    ref = nn.parallel.DistributedDataParallel(_mlp())
    for step in range(3):
        for model in (ours, ref):
            model.zero_grad()
            model(_batch(step)).pow(2).mean().backward()
        # Chunks span parameters, so the step is set by the bucket's range; error feedback adds
        # up to one step of the previous one: a few steps of the largest gradient in all.
        scale = max(float(b.grad.abs().max()) for b in ref.parameters())
        for a, b in zip(ours.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=4 * 2 * scale / 255)
            assert torch.equal(*_gather(a.grad.contiguous()))
    assert ours.hyperparameters.is_hierarchical_reduce is False
    # Decentralized: gradients stay local; after the next forward, weights are the peers'
    # average moved by the local update.
    for algorithm in (Decentralized(), AsyncModelAverage(interval_seconds=0.0)):
        model = distune.DistributedDataParallel(nn.Linear(12, 3).double(), algorithm=algorithm)
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float(dist.get_rank()))  # ranks differ (construction broadcast them)
        model(_batch(0).double()).sum().backward()
        local = [p.grad.clone() for p in model.parameters()]
        assert not torch.equal(*_gather(local[0])), "gradients must stay local"
        model.finish()
        results[type(algorithm).__name__] = [float(p.mean()) for p in model.parameters()]
        assert all(torch.equal(*_gather(p.detach())) for p in model.parameters())
    # With nothing trained, both end on the average of rank 0's zeros and rank 1's ones.
    assert results["Decentralized"] == [0.5, 0.5], results
    assert results["AsyncModelAverage"] == [0.5, 0.5], results
    with pytest.raises(RuntimeError, match="already does something else"):
        model.register_comm_hook(None, lambda state, bucket: None)
    with pytest.raises(TypeError, match="algorithm must be one of"):
        distune.DistributedDataParallel(_mlp(), algorithm="LowPrecision")
    return results


@scenario
def hierarchical_low_precision(out: Path) -> dict[str, Any]:
    """2 nodes x 2 ranks: exact inside the node, 8-bit between the node leaders."""
    import distune

    ours = distune.DistributedDataParallel(_mlp(), algorithm=LowPrecision(bits=8))
    flat = distune.DistributedDataParallel(
        _mlp(), algorithm=LowPrecision(bits=8, hierarchical=False)
    )
    ref = nn.parallel.DistributedDataParallel(_mlp())
    assert ours.topology.hierarchical_possible  # so the leaders' exchange is what ran
    for step in range(3):
        for model in (ours, flat, ref):
            model.zero_grad()
            model(_batch(step)).pow(2).mean().backward()
        scale = max(float(b.grad.abs().max()) for b in ref.parameters())
        for a, b in zip(ours.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=4 * 2 * scale / 255)
            assert all(torch.equal(a.grad, other) for other in _gather(a.grad.contiguous()))
    return {}


@scenario
def model_averaging(out: Path) -> dict[str, Any]:
    return {"decentralized": decentralized(out), "async_model_average": async_model_average(out)}


#: The scenarios of one node of two ranks: one job runs them all.
ONE_NODE = ["comm_hooks", "through_the_wrapper", "low_precision", "model_averaging"]


@pytest.fixture(scope="module")
def one_node(tmp_path_factory) -> dict[str, list[Any]]:
    """Each of ``ONE_NODE``'s results by rank, from one 2-rank job."""
    return run_scenarios(__file__, ONE_NODE, tmp_path_factory.mktemp("one_node"), timeout=150)


def test_comm_hooks_give_torch_ddps_gradients(one_node):
    assert one_node["comm_hooks"] == [{}, {}]  # the ranks compared with torch's DDP


def test_algorithms_through_the_wrapper(one_node):
    assert all(r["Decentralized"] == [0.5, 0.5] for r in one_node["through_the_wrapper"])


def test_hierarchical_low_precision_on_two_nodes_of_two_ranks(tmp_path):
    run_job(__file__, "hierarchical_low_precision", tmp_path, nodes=2, per_node=2)


def test_low_precision_within_one_step_and_error_feedback_keeps_the_sum(one_node):
    results = one_node["low_precision"]
    assert results[0] == results[1]


def test_decentralized_averages_peers_and_async_ends_identical_at_uneven_stops(one_node):
    # Rank 0 finished after 5 of rank 1's 40 steps and joined rounds until rank 1 finished.
    assert all(r["async_model_average"]["rounds"] > 1 for r in one_node["model_averaging"])


if __name__ == "__main__":
    worker_main(SCENARIOS)
