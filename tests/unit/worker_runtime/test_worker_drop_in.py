"""distune's wrapper as a drop-in for torch DDP, in one process (a gloo world of one rank):
torch's constructor arguments, copies, a replaced submodule, unwrapping, and the lifecycle of
wrappers that tune (names, a dropped wrapper, a refused registration)."""

from __future__ import annotations

import copy
import gc
import io
import logging
import pickle
import weakref

import pytest
import torch
import torch.distributed as dist
from test_worker_tuning import ScriptedService, group, train_until
from torch import nn

import distune
from distune import Hyperparameters
from distune.worker_runtime.reducer import ReductionError

TorchDDP = nn.parallel.DistributedDataParallel


@pytest.fixture
def world(monkeypatch):
    for name in ("DISTUNE_AUTOTUNE_LEVEL", "DISTUNE_SERVICE_URL", "DISTUNE_BUCKET_SIZE"):
        monkeypatch.delenv(name, raising=False)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def tuning_world(monkeypatch):
    """As test_worker_tuning's: a one-rank world tuning against the service at a URL."""

    def start(url: str) -> None:
        monkeypatch.setenv("DISTUNE_AUTOTUNE_LEVEL", "1")
        monkeypatch.setenv("DISTUNE_SERVICE_URL", url)
        monkeypatch.setenv("DISTUNE_SYNC_INTERVAL", "0.02")
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)

    yield start
    if dist.is_initialized():
        dist.destroy_process_group()


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 4))


def step(model: nn.Module) -> None:
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(1))
    model(x).pow(2).sum().backward()


def test_torch_ddps_positional_arguments_and_flags_are_accepted(world):
    args = (None, None, 0, True, True, None, None, True, False, True, True)  # torch's order
    ours, ref = distune.DistributedDataParallel(mlp(), *args), TorchDDP(mlp(), *args)
    for model in (ours, ref):
        step(model)
    assert ours.broadcast_buffers and ours.process_group is dist.group.WORLD
    for a, b in zip(ours.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad)


def test_bucket_cap_mb_pins_the_bucket_size(world):
    model = distune.DistributedDataParallel(mlp(), bucket_cap_mb=1 / 256)  # 4 KiB
    assert model.hyperparameters == Hyperparameters(12, False)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"bucket_cap_mb": 1, "bucket_size": 2**20}, ValueError, "not both"),
        ({"bucket_cap_mb": -1}, ValueError, "positive number of MiB"),
        ({"output_device": "cuda:0"}, ValueError, "outputs stay on its device"),
        ({"device_ids": ["cuda:0"]}, ValueError, "device_ids=None for a CPU module"),
        ({"find_unused_parameters": "yes"}, TypeError, "find_unused_parameters must be True"),
        ({"dim": 1.5}, TypeError, "dim must be an int"),
    ],
)
def test_torch_arguments_that_cannot_apply_say_why(world, kwargs, error, message):
    with pytest.raises(error, match=message):
        distune.DistributedDataParallel(mlp(), **kwargs)


def test_output_device_of_the_modules_device_is_accepted(world):
    distune.DistributedDataParallel(mlp(), output_device="cpu")


def test_join_refuses_dividing_by_the_joined_world_size(world):
    model = distune.DistributedDataParallel(mlp())
    with pytest.raises(ValueError, match="divide_by_initial_world_size must be True"):
        model.join(divide_by_initial_world_size=False)


def test_set_hyperparameters_reports_what_runs_on_one_node(world):
    model = distune.DistributedDataParallel(mlp())
    model.set_hyperparameters(Hyperparameters(12, True))
    assert model.hyperparameters == Hyperparameters(12, False)


def test_deepcopy_pickle_and_torch_save_work_like_torch_ddps(world):
    ours = distune.DistributedDataParallel(mlp(), bucket_size=2**12)
    step(ours)
    ema = copy.deepcopy(ours)
    torch_ema = copy.deepcopy(TorchDDP(mlp()))
    assert isinstance(torch_ema, TorchDDP)
    buffer = io.BytesIO()
    torch.save(ours, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    pickled = pickle.loads(pickle.dumps(ours))
    for copied in (ema, loaded, pickled):
        assert copied.hyperparameters == ours.hyperparameters
        assert copied.state_dict().keys() == ours.state_dict().keys()
        for a, b in zip(copied.parameters(), ours.parameters(), strict=True):
            assert a is not b and torch.equal(a, b)
        step(copied)  # a copy trains on its own reducer, the original's hooks stay out of it
        assert copied._reducer.iterations == 1
    assert ours._reducer.iterations == 1


def test_a_copy_loaded_without_a_process_group_runs_inference_only(world):
    data = pickle.dumps(distune.DistributedDataParallel(mlp()))
    dist.destroy_process_group()
    try:
        loaded = pickle.loads(data).eval()
        with torch.no_grad():
            assert loaded(torch.randn(2, 16)).shape == (2, 4)
        with pytest.raises(RuntimeError, match=r"torch.distributed is not initialized"):
            loaded(torch.randn(2, 16))
    finally:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def test_a_submodule_replaced_after_wrapping_is_an_error(world):
    model = distune.DistributedDataParallel(mlp())
    step(model)
    model.module[3] = nn.Linear(64, 4)
    with pytest.raises(ReductionError, match=r"3\.weight, 3\.bias.*Wrap the module again"):
        step(model)


def test_libraries_unwrap_it_through_module(world):
    inner = mlp()
    model = distune.DistributedDataParallel(inner)
    unwrapped = model
    while hasattr(unwrapped, "module"):  # transformers' unwrap_model, Lightning's unwrapping
        unwrapped = unwrapped.module
    assert unwrapped is inner
    assert list(model.state_dict()) == list(TorchDDP(mlp()).state_dict())


# -- wrappers that tune ------------------------------------------------------------------------


def test_a_dropped_wrapper_is_freed_at_once_and_closes_its_thread(tuning_world):
    with ScriptedService() as service:
        tuning_world(service.url)
        service.current = group(1, Hyperparameters(16, False))  # Linear(64, 8)'s only group
        gc.disable()
        try:
            model = distune.DistributedDataParallel(nn.Linear(64, 8))
            train_until(model, lambda: "report" in service.actions())
            client = model._sync._client
            dropped = weakref.ref(model)
            del model
            assert dropped() is None, "a reference cycle keeps the dropped wrapper alive"
        finally:
            gc.enable()
        client._thread.join(timeout=5)
        assert not client.alive


def test_two_models_with_one_name_are_refused_at_construction(tuning_world):
    with ScriptedService() as service:
        tuning_world(service.url)
        first = distune.DistributedDataParallel(nn.Linear(64, 8))
        with pytest.raises(ValueError, match=r"two models are named 'model0'.*own name="):
            distune.DistributedDataParallel(nn.Linear(64, 8))
        second = distune.DistributedDataParallel(nn.Linear(64, 8), name="other")
        assert first._sync is not None and second._sync is not None


def test_rewrapping_the_same_parameters_takes_the_name_over(tuning_world):
    with ScriptedService() as service:
        tuning_world(service.url)
        module = nn.Linear(64, 8)
        old = distune.DistributedDataParallel(module)
        new = distune.DistributedDataParallel(module)
        assert old._sync.stopped
        old._sync._client._thread.join(timeout=5)
        assert not old._sync._client.alive
        assert not new._sync.stopped


def test_a_refused_registration_shows_the_services_message_and_stops_tuning(tuning_world, caplog):
    with ScriptedService() as service:
        tuning_world(service.url)
        service.respond = lambda action, body: (
            409,
            {"error": "model 'model0' is already registered with other facts (...)"},
        )
        with caplog.at_level(logging.WARNING):
            model = distune.DistributedDataParallel(nn.Linear(64, 8))
            train_until(model, lambda: model._sync.stopped)
    assert service.actions() == ["register"], "a refusal is not retried"
    messages = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(messages) == 1
    assert "refused model 'model0': model 'model0' is already registered" in messages[0]
