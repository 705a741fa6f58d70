"""distune.DistributedDataParallel in one process (a gloo world of one rank)."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

import distune
from distune import Hyperparameters
from distune.worker_runtime.distributed import UnsupportedModuleError
from distune.worker_runtime.reducer import ReductionError


@pytest.fixture
def world(monkeypatch):
    for name in (
        "DISTUNE_AUTOTUNE_LEVEL",
        "DISTUNE_SERVICE_URL",
        "DISTUNE_BUCKET_SIZE",
        "DISTUNE_HIERARCHICAL_REDUCE",
        "DISTUNE_DEFAULT_BUCKET_SIZE",
    ):
        monkeypatch.delenv(name, raising=False)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def mlp() -> nn.Module:
    torch.manual_seed(0)
    # fp32 gradient bytes: 4096 + 256 + 1024 + 16 = 5392 -> the space tops out at 2^16.
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))


def step(model: nn.Module) -> None:
    model(torch.randn(3, 16)).sum().backward()


def test_needs_an_initialized_process_group():
    with pytest.raises(RuntimeError, match="init_process_group"):
        distune.DistributedDataParallel(mlp())


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"name": "my model"}, ValueError, r"\[A-Za-z0-9._-\]"),
        ({"name": ""}, ValueError, "1-64 characters"),
        # requests sent its registration to /api/v1/register (dot segments are removed)
        ({"name": ".."}, ValueError, r"other than \. and \.\."),
        ({"bucket_size": 0}, ValueError, "positive number of bytes"),
        ({"bucket_size": 1.5}, ValueError, "whole number of bytes"),
        ({"hierarchical": "yes"}, TypeError, "True, False or None"),
        ({"device_ids": [0]}, ValueError, "device_ids=None for a CPU module"),
    ],
)
def test_bad_arguments_say_what_is_allowed(world, kwargs, error, message):
    with pytest.raises(error, match=message):
        distune.DistributedDataParallel(mlp(), **kwargs)


def test_a_module_without_trainable_parameters_is_refused(world):
    frozen = mlp().requires_grad_(False)
    with pytest.raises(ValueError, match="no parameter that requires a gradient"):
        distune.DistributedDataParallel(frozen)


def test_defaults_are_the_spaces_default_group(world):
    model = distune.DistributedDataParallel(mlp())
    # 25 MiB rounds to 2^25, clamped to the first power of two above the model: 2^16.
    assert model.hyperparameters == Hyperparameters(16, False)
    assert model.module is not None and model.name == "model0"


def test_constructor_pins_beat_environment_pins_beat_defaults(world, monkeypatch):
    def wide() -> nn.Module:
        return nn.Linear(1024, 512)  # 2 MiB + 2 KiB of gradients: the space tops at 2^22

    assert distune.DistributedDataParallel(wide()).hyperparameters.bucket_size_2p == 22
    monkeypatch.setenv("DISTUNE_DEFAULT_BUCKET_SIZE", str(2**18))
    assert distune.DistributedDataParallel(wide()).hyperparameters.bucket_size_2p == 18
    monkeypatch.setenv("DISTUNE_BUCKET_SIZE", str(3000))  # rounds to 2^12
    assert distune.DistributedDataParallel(wide()).hyperparameters.bucket_size_2p == 12
    model = distune.DistributedDataParallel(wide(), bucket_size=600)  # rounds to 2^9
    assert model.hyperparameters.bucket_size_2p == 9


def test_hierarchical_on_one_node_runs_flat(world):
    model = distune.DistributedDataParallel(mlp(), hierarchical=True)
    assert model.hyperparameters.is_hierarchical_reduce is False


def test_state_dict_has_torch_ddps_module_prefix_and_loads_back(world):
    model = distune.DistributedDataParallel(mlp())
    state = model.state_dict()
    assert list(state) == [f"module.{key}" for key in mlp().state_dict()]
    other = distune.DistributedDataParallel(
        nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    )
    other.load_state_dict(state)
    assert torch.equal(other.module[0].weight, model.module[0].weight)


def test_gradients_are_views_of_the_buckets(world):
    model = distune.DistributedDataParallel(mlp(), bucket_size=2**12)
    step(model)
    flats = [bucket.flat for bucket in model._reducer._buckets]
    assert len(flats) == 2
    for param in model.parameters():
        storage = param.grad.untyped_storage().data_ptr()
        assert storage in {flat.untyped_storage().data_ptr() for flat in flats}


def test_set_hyperparameters_rebuilds_buckets_and_keeps_gradients(world):
    model = distune.DistributedDataParallel(mlp(), bucket_size=2**16)
    with model.no_sync():
        step(model)
    grads = [p.grad.clone() for p in model.parameters()]
    model.set_hyperparameters(Hyperparameters(0, False))
    assert model.hyperparameters == Hyperparameters(0, False)
    assert model._reducer.bucket_sizes == [16, 1024, 256, 4096]  # one per parameter
    for param, grad in zip(model.parameters(), grads, strict=True):
        assert torch.equal(param.grad, grad)
    step(model)  # accumulates onto the kept gradients, in the new buckets
    for param, grad in zip(model.parameters(), grads, strict=True):
        assert not torch.equal(param.grad, grad)
    with pytest.raises(TypeError, match=r"distune\.Hyperparameters"):
        model.set_hyperparameters({"bucket_size_2p": 10, "is_hierarchical_reduce": False})


def test_grads_set_to_none_are_rebound_to_the_buckets(world):
    model = distune.DistributedDataParallel(mlp())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        optimizer.zero_grad()  # set_to_none=True
        step(model)
        (bucket,) = model._reducer._buckets
        assert model.module[0].weight.grad.data_ptr() == bucket.views[-1].data_ptr()
        optimizer.step()


class Partly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(4, 2)
        self.unused = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def test_a_parameter_no_rank_used_keeps_a_none_gradient(world):
    model = distune.DistributedDataParallel(Partly())
    model(torch.randn(2, 4)).sum().backward()
    assert model.module.used.weight.grad is not None
    assert model.module.unused.weight.grad is None


def test_a_stale_gradient_of_an_unused_parameter_is_averaged_not_lost(world):
    model = distune.DistributedDataParallel(Partly())
    model.module.unused.weight.grad = torch.ones(2, 4)
    model(torch.randn(2, 4)).sum().backward()
    assert torch.equal(model.module.unused.weight.grad, torch.ones(2, 4))


class SparseLookup(nn.Module):
    """A sparse gradient no constructor check can see: ``F.embedding(..., sparse=True)``."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(10, 3))

    def forward(self, index: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(index, self.table, sparse=True)


def test_sparse_embeddings_are_refused_at_construction_by_name(world):
    model = nn.Sequential(nn.Linear(3, 3), nn.Embedding(10, 3, sparse=True))
    with pytest.raises(UnsupportedModuleError, match=r"submodule '1' is an Embedding"):
        distune.DistributedDataParallel(model)


def test_sparse_gradients_are_refused_by_name(world):
    model = distune.DistributedDataParallel(SparseLookup())
    with pytest.raises(ReductionError, match="'table' has a sparse gradient"):
        model(torch.tensor([1, 2])).sum().backward()


def test_a_backward_left_half_done_is_reported_at_the_next_forward(world):
    model = distune.DistributedDataParallel(SparseLookup())
    with pytest.raises(ReductionError):
        model(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(ReductionError, match="did backward raise"):
        model(torch.tensor([1, 2]))


def test_forward_without_grad_needs_no_backward(world):
    model = distune.DistributedDataParallel(mlp())
    with torch.no_grad():
        model(torch.randn(2, 16))
    step(model)
    assert model._reducer.iterations == 1
