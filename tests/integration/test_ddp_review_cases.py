"""The review's wrong-result, hang and leak cases, side by side with torch DDP (2 gloo ranks).

Each scenario trains distune's wrapper and torch's on the same model and data, off the main
path (two wrappers of one model, a backward through ``.module``, forwards in and out of
``no_sync``, complex parameters, reentrant checkpointing, uneven inputs, buffers), and compares
gradients after every backward and parameters at the end. Scenarios of one test run in one job
(processes start slowly on a loaded machine); each returns what its test asserts.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from ddp_launch import run_scenarios, worker_main
from test_ddp_correctness import assert_grads_equal, assert_params_equal, batch, loss_of, make_model
from torch import nn
from torch.utils.checkpoint import checkpoint

import distune

pytestmark = pytest.mark.slow
SCENARIOS = {}
TorchDDP = nn.parallel.DistributedDataParallel


def scenario(fn):
    SCENARIOS[fn.__name__] = fn
    return fn


def pair(module_of: Any, **ours: Any) -> tuple[nn.Module, nn.Module]:
    """distune's wrapper and torch's over two copies of ``module_of()``."""
    return distune.DistributedDataParallel(module_of(), **ours), TorchDDP(module_of())


def sgd(*models: nn.Module) -> list[torch.optim.Optimizer]:
    return [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in models]


# -- 1. two wrappers over the same parameters ---------------------------------------------------


@scenario
def rewrapped(out: Path) -> dict:
    """A second wrapper over the same module while the first is still referenced: the first
    stays inert, as torch's stale reducer does; gradients are the true average."""
    ours_module, ref_module = make_model(), make_model()
    stale = [distune.DistributedDataParallel(ours_module, bucket_size=2**10)]
    stale.append(TorchDDP(ref_module))
    ours = distune.DistributedDataParallel(ours_module, bucket_size=2**12)
    ref = TorchDDP(ref_module)
    optimizers = sgd(ours, ref)
    for step in range(3):
        for model, optimizer in zip((ours, ref), optimizers, strict=True):
            optimizer.zero_grad()
            loss_of(model, batch(step)).backward()
        assert_grads_equal(ours, ref, f"re-wrapped, step {step}")
        for optimizer in optimizers:
            optimizer.step()
    assert stale[0]._reducer.iterations == 0
    return {"iterations": ours._reducer.iterations}


# -- 2. backward through model.module -----------------------------------------------------------


@scenario
def backward_through_module(out: Path) -> dict:
    """On rank 1 only, a saliency backward through ``.module`` between training steps: local,
    as with torch DDP (it would hang if it were averaged), and it leaks nothing."""
    ours, ref = pair(make_model, bucket_size=2**11)
    optimizers = sgd(ours, ref)
    spares = []
    for step in range(4):
        for model, optimizer in zip((ours, ref), optimizers, strict=True):
            optimizer.zero_grad(set_to_none=True)
            loss_of(model, batch(step)).backward()
            if dist.get_rank() == 1:
                x = batch(100 + step).requires_grad_()
                model.module(x).sum().backward()
        assert_grads_equal(ours, ref, f"saliency on rank 1, step {step}")
        for optimizer in optimizers:
            optimizer.step()
        spares.append(len(ours._reducer._spares))
    return {"iterations": ours._reducer.iterations, "spares": spares}


# -- 3. a forward outside no_sync, then one inside ----------------------------------------------


@scenario
def forwards_in_and_out_of_no_sync(out: Path) -> dict:
    ours, ref = pair(make_model, bucket_size=2**11)
    optimizers = sgd(ours, ref)
    for step in range(3):
        for model, optimizer in zip((ours, ref), optimizers, strict=True):
            optimizer.zero_grad()
            a = loss_of(model, batch(2 * step))
            with model.no_sync():
                b = loss_of(model, batch(2 * step + 1))
            (a + b).backward()
        assert_grads_equal(ours, ref, f"a outside, b inside no_sync, step {step}")
        for optimizer in optimizers:
            optimizer.step()
    assert_params_equal(ours.module, ref.module, "after training")
    return {}


# -- 4. complex parameters, unused on one rank --------------------------------------------------


class ComplexBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.real = nn.Linear(12, 3)
        self.phase = nn.Parameter(torch.randn(3, dtype=torch.complex64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.real(x)
        if dist.get_rank() == 1:  # the complex parameter gets a gradient on rank 1 only
            out = out + (out.to(torch.complex64) * self.phase).abs()
        return out


@scenario
def complex_parameters(out: Path) -> dict:
    ours = distune.DistributedDataParallel(ComplexBranch(), bucket_size=2**6)
    ref = TorchDDP(ComplexBranch(), find_unused_parameters=True)
    optimizers = sgd(ours, ref)
    for step in range(3):
        for model, optimizer in zip((ours, ref), optimizers, strict=True):
            optimizer.zero_grad()
            loss_of(model, batch(step)).backward()
        assert_grads_equal(ours, ref, f"complex, step {step}")
        assert ours.module.phase.grad is not None
        for optimizer in optimizers:
            optimizer.step()
    return {}


# -- 5. reentrant checkpointing ------------------------------------------------------------------


class Checkpointed(nn.Module):
    """``where='top'``: the output layers run under reentrant checkpointing, so their
    gradients come in a backward nested in the outer one, before the bottom layer's;
    ``'top_unused'``: the same with a parameter no backward reaches (the nested backward ends
    with it pending, and no hook comes after the bottom layer's); ``'all'``: the whole network
    is one reentrant checkpoint."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.net = make_model()
        self.where = where
        if where == "top_unused":
            self.spare = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, rest = self.net[0], self.net[1:]
        if self.where.startswith("top"):
            return checkpoint(rest, first(x), use_reentrant=True)
        return checkpoint(self.net, x.requires_grad_(), use_reentrant=True)


@scenario
def reentrant_checkpointing(out: Path) -> dict:
    iterations = {}
    for where in ("top", "top_unused", "all"):
        ours = distune.DistributedDataParallel(Checkpointed(where), bucket_size=2**11)
        # torch's find_unused_parameters fails under reentrant checkpointing (a gradient
        # "marked ready twice"); static_graph is torch's way to have both.
        ref = TorchDDP(Checkpointed(where), static_graph=where == "top_unused")
        optimizers = sgd(ours, ref)
        for step in range(3):
            for model, optimizer in zip((ours, ref), optimizers, strict=True):
                optimizer.zero_grad()
                loss_of(model, batch(step)).backward()
            assert_grads_equal(ours, ref, f"checkpoint {where}, step {step}")
            for optimizer in optimizers:
                optimizer.step()
        iterations[where] = ours._reducer.iterations
    return {"iterations": iterations}


# -- drop-in: consistency, buffers, uneven inputs -------------------------------------------------


@scenario
def different_models_are_refused(out: Path) -> dict:
    width = 32 if dist.get_rank() == 0 else 33
    errors = []
    layers = 1 + dist.get_rank()
    for module in (nn.Linear(width, 4), nn.Sequential(*(nn.Linear(4, 4) for _ in range(layers)))):
        try:
            distune.DistributedDataParallel(module)
        except ValueError as error:  # ModelMismatchError
            errors.append(str(error))
    return {"errors": errors}


@scenario
def rank_zero_starting_group_wins(out: Path) -> dict:
    if dist.get_rank() == 1:
        os.environ["DISTUNE_BUCKET_SIZE"] = "1024"
    ours, ref = pair(make_model)
    optimizers = sgd(ours, ref)
    for step in range(2):
        for model, optimizer in zip((ours, ref), optimizers, strict=True):
            optimizer.zero_grad()
            loss_of(model, batch(step)).backward()
        assert_grads_equal(ours, ref, f"step {step}")
        for optimizer in optimizers:
            optimizer.step()
    return {"hyperparameters": ours.hyperparameters.to_dict()}


def with_batch_norm() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 5))


@scenario
def buffers_broadcast_each_forward(out: Path) -> dict:
    """Running statistics are rank 0's before each averaged forward with
    ``broadcast_buffers=True`` (the default), and stay each rank's own with False."""
    kept = {}
    for broadcast in (True, False):
        ours = distune.DistributedDataParallel(with_batch_norm(), broadcast_buffers=broadcast)
        ref = TorchDDP(with_batch_norm(), broadcast_buffers=broadcast)
        optimizers = sgd(ours, ref)
        for step in range(3):
            for model, optimizer in zip((ours, ref), optimizers, strict=True):
                optimizer.zero_grad()
                loss_of(model, batch(step)).backward()
            assert_grads_equal(ours, ref, f"broadcast_buffers={broadcast}, step {step}")
            for optimizer in optimizers:
                optimizer.step()
        assert_params_equal(ours.module, ref.module, f"broadcast_buffers={broadcast}")
        for a, b in zip(ours.module.buffers(), ref.module.buffers(), strict=True):
            torch.testing.assert_close(a, b)
        kept[str(broadcast)] = ours.module[1].running_mean.tolist()
    return kept


@scenario
def uneven_inputs_with_join(out: Path) -> dict:
    """Rank 1 has two batches more than rank 0; ``with model.join():`` as with torch DDP."""
    ours, ref = pair(with_batch_norm)
    optimizers = sgd(ours, ref)
    batches = 3 + 2 * dist.get_rank()
    for model, optimizer in zip((ours, ref), optimizers, strict=True):
        with model.join():
            for step in range(batches):
                optimizer.zero_grad()
                loss_of(model, batch(step)).backward()
                optimizer.step()
    assert_params_equal(ours.module, ref.module, "after join")
    for a, b in zip(ours.module.buffers(), ref.module.buffers(), strict=True):
        torch.testing.assert_close(a, b)
    return {"iterations": ours._reducer.iterations}


#: Every scenario, in one job (a process start is seconds): cases 1-5 of the review, then the
#: drop-in cases; the last one sets an environment variable on rank 1, so it stays last.
CASES = [
    "rewrapped",
    "backward_through_module",
    "forwards_in_and_out_of_no_sync",
    "complex_parameters",
    "reentrant_checkpointing",
    "different_models_are_refused",
    "buffers_broadcast_each_forward",
    "uneven_inputs_with_join",
    "rank_zero_starting_group_wins",
]


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> dict[str, list[Any]]:
    """Each of ``CASES``' results by rank, from one 2-rank job."""
    return run_scenarios(__file__, CASES, tmp_path_factory.mktemp("review_cases"), timeout=150)


def test_a_second_wrapper_leaves_the_first_inert(cases):
    assert [r["iterations"] for r in cases["rewrapped"]] == [3, 3]


def test_backward_through_module_stays_local_and_leaks_nothing(cases):
    results = cases["backward_through_module"]
    assert all(r["iterations"] == 4 for r in results)
    # Spare gradient tensors are freed at each forward: never more than the six parameters.
    assert all(max(r["spares"]) <= 6 for r in results), results


def test_a_forward_outside_no_sync_makes_the_backward_average(cases):
    assert cases["forwards_in_and_out_of_no_sync"] == [{}, {}]


def test_complex_parameters_unused_on_one_rank(cases):
    assert cases["complex_parameters"] == [{}, {}]


def test_reentrant_checkpointing_is_one_reduction_per_backward(cases):
    for result in cases["reentrant_checkpointing"]:
        assert result["iterations"] == {"top": 3, "top_unused": 3, "all": 3}


def test_ranks_that_wrap_different_models_all_raise_naming_the_difference(cases):
    first, second = (r["errors"] for r in cases["different_models_are_refused"])
    assert first == second and len(first) == 2
    assert "'weight' is [4, 33] torch.float32 where rank 0's 'weight' is [4, 32]" in first[0]
    assert "rank 1: 4 trainable parameters where rank 0 has 2" in first[1]


def test_buffers_are_broadcast_each_forward_like_torch_ddp(cases):
    # Each rank matched torch's buffers in the job; broadcasting changes rank 1's only.
    kept = cases["buffers_broadcast_each_forward"]
    assert kept[0]["True"] == kept[0]["False"]
    assert kept[1]["True"] != kept[1]["False"]


def test_join_handles_uneven_inputs_like_torch_ddp(cases):
    assert [r["iterations"] for r in cases["uneven_inputs_with_join"]] == [5, 5]


def test_every_rank_starts_on_rank_zeros_group(cases):
    groups = [r["hyperparameters"] for r in cases["rank_zero_starting_group_wins"]]
    assert groups[0] == groups[1] == {"bucket_size_2p": 16, "is_hierarchical_reduce": False}


if __name__ == "__main__":
    worker_main(SCENARIOS)
