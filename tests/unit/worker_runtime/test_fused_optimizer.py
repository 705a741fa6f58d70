"""distune.fuse_optimizer: same training as the unfused optimizer, over a few flat tensors."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

import distune
from distune.worker_runtime.fused_optimizer import FusedOptimizer

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]

OPTIMIZERS: dict[str, OptimizerFactory] = {
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=1e-3),
    "sgd_nesterov": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
}


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(6):
        layers += [nn.Linear(8, 8), nn.LayerNorm(8), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(8, 1))


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    gen = torch.Generator().manual_seed(step)
    x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 1, generator=gen)
    optimizer.zero_grad(set_to_none=step % 2 == 0)  # both ways of clearing gradients
    nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()


def _assert_same_params(a: nn.Module, b: nn.Module) -> None:
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_fused_matches_unfused_over_many_steps(kind: str) -> None:
    reference, fused_model = _model(), _model()
    unfused = OPTIMIZERS[kind](list(reference.parameters()))
    fused = distune.fuse_optimizer(OPTIMIZERS[kind](list(fused_model.parameters())))
    assert len(fused.param_groups[0]["params"]) == 1  # one float32 CPU flat tensor
    for step in range(60):
        _train_step(reference, unfused, step)
        _train_step(fused_model, fused, step)
    _assert_same_params(reference, fused_model)
    # The model trains on the flat tensor's memory: its parameters are views of it.
    (flat,) = fused.param_groups[0]["params"]
    for param in fused_model.parameters():
        assert param.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()


def test_groups_dtypes_and_scheduler() -> None:
    reference, fused_model = _model(), _model()
    for model in (reference, fused_model):
        model[0].double()  # a second dtype: a second flat tensor in its group

    def groups(model: nn.Module) -> list[dict[str, object]]:
        return [
            {"params": list(model[:9].parameters()), "lr": 0.1},
            {"params": list(model[9:].parameters())},
        ]

    unfused = torch.optim.SGD(groups(reference), lr=0.01, momentum=0.5)
    fused = distune.fuse_optimizer(torch.optim.SGD(groups(fused_model), lr=0.01, momentum=0.5))
    assert [len(g["params"]) for g in fused.param_groups] == [2, 1]
    schedulers = [
        torch.optim.lr_scheduler.StepLR(o, step_size=5, gamma=0.5) for o in (unfused, fused)
    ]

    def step(model: nn.Module, optimizer: torch.optim.Optimizer, i: int) -> None:
        gen = torch.Generator().manual_seed(i)
        x = torch.randn(4, 8, generator=gen)
        optimizer.zero_grad()
        model[0](x.double()).float().sum().backward(retain_graph=False)
        model[1:](x).pow(2).mean().backward()
        optimizer.step()

    for i in range(20):
        step(reference, unfused, i)
        step(fused_model, fused, i)
        for scheduler in schedulers:
            scheduler.step()
    assert fused.param_groups[0]["lr"] == unfused.param_groups[0]["lr"] == 0.1 * 0.5**4
    _assert_same_params(reference, fused_model)


@pytest.mark.parametrize("kind", ["sgd_momentum", "adamw"])
def test_state_dict_round_trips_between_fused_and_unfused(kind: str) -> None:
    reference, fused_model = _model(), _model()
    unfused = OPTIMIZERS[kind](list(reference.parameters()))
    fused = distune.fuse_optimizer(OPTIMIZERS[kind](list(fused_model.parameters())))
    for step in range(5):
        _train_step(reference, unfused, step)
        _train_step(fused_model, fused, step)

    saved = fused.state_dict()
    assert sorted(saved["state"]) == list(range(len(list(fused_model.parameters()))))
    # The fused checkpoint is an unfused one: an unfused optimizer resumes from it...
    resumed_model = copy.deepcopy(reference)
    resumed = OPTIMIZERS[kind](list(resumed_model.parameters()))
    resumed.load_state_dict(saved)
    # ...and a resumed unfused optimizer fuses with its state.
    refused_model = copy.deepcopy(reference)
    refused_unfused = OPTIMIZERS[kind](list(refused_model.parameters()))
    refused_unfused.load_state_dict(copy.deepcopy(unfused.state_dict()))
    refused = distune.fuse_optimizer(refused_unfused)
    # ...and a fused optimizer loads an unfused checkpoint.
    fused.load_state_dict(copy.deepcopy(unfused.state_dict()))

    for step in range(5, 15):
        for model, optimizer in [
            (reference, unfused),
            (fused_model, fused),
            (resumed_model, resumed),
            (refused_model, refused),
        ]:
            _train_step(model, optimizer, step)
    for model in (fused_model, resumed_model, refused_model):
        _assert_same_params(reference, model)


def test_closure_is_supported() -> None:
    reference, fused_model = _model(), _model()
    unfused = torch.optim.SGD(reference.parameters(), lr=0.1)
    fused = distune.fuse_optimizer(torch.optim.SGD(fused_model.parameters(), lr=0.1))
    x = torch.randn(4, 8)
    for model, optimizer in [(reference, unfused), (fused_model, fused)]:

        def closure(model: nn.Module = model, optimizer: torch.optim.Optimizer = optimizer):
            optimizer.zero_grad()
            loss = model(x).sum()
            loss.backward()
            return loss

        assert optimizer.step(closure) is not None
    _assert_same_params(reference, fused_model)


def test_parameter_without_gradient_is_skipped_when_its_whole_flat_is() -> None:
    model = nn.Linear(3, 3)
    before = [p.detach().clone() for p in model.parameters()]
    fused = distune.fuse_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=1))
    fused.zero_grad()
    fused.step()  # no gradients at all: nothing moves, as unfused
    for p, b in zip(model.parameters(), before, strict=True):
        assert torch.equal(p, b)


def test_bad_input_is_named() -> None:
    fused = distune.fuse_optimizer(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1))
    assert isinstance(fused, FusedOptimizer)
    assert isinstance(fused, torch.optim.Optimizer)
    with pytest.raises(ValueError, match="already fused"):
        distune.fuse_optimizer(fused)
    with pytest.raises(TypeError, match=r"torch\.optim\.Optimizer"):
        distune.fuse_optimizer(nn.Linear(2, 2))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="parameter group"):
        fused.load_state_dict({"state": {}, "param_groups": []})
