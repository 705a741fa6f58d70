"""distune's wrapper as a drop-in for torch DDP, in one process (a gloo world of one rank):
torch's constructor arguments, copies, a replaced submodule, unwrapping, and the lifecycle of
wrappers that tune (names, a dropped wrapper, a refused registration)."""

from __future__ import annotations

import copy
import gc
import inspect
import io
import logging
import pickle
import time
import warnings
import weakref

import pytest
import torch
import torch.distributed as dist
from test_worker_tuning import ScriptedService, group, train_until, wait_for
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import (
    allreduce_hook,
    fp16_compress_hook,
    fp16_compress_wrapper,
)
from torch.distributed.device_mesh import init_device_mesh

import distune
from distune import Hyperparameters
from distune.algorithms import AsyncModelAverage
from distune.worker_runtime import distributed
from distune.worker_runtime.distributed import UnsupportedModuleError
from distune.worker_runtime.model_names import ModelNameError, NameRegistry
from distune.worker_runtime.reducer import ReductionError
from distune.worker_runtime.torch_ddp_arguments import TorchDDPArguments, UnsupportedArgumentError

TorchDDP = nn.parallel.DistributedDataParallel
needs_torch_2_13 = pytest.mark.skipif(
    "forward_sync_buffers" not in inspect.signature(TorchDDP.__init__).parameters,
    reason="torch < 2.13's arguments",
)


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

    # Names as in a fresh process: a wrapper an earlier test keeps alive (a failed test's
    # traceback holds its frames) must not number this test's models on.
    monkeypatch.setattr(distributed, "NAMES_IN_USE", NameRegistry())

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


def test_bucket_cap_mb_may_be_a_numpy_number_as_in_torch(world):
    import numpy as np

    model = distune.DistributedDataParallel(mlp(), bucket_cap_mb=np.float32(1 / 256))
    assert model.hyperparameters == Hyperparameters(12, False)


def test_bucket_cap_mb_zero_is_torchs_bucket_per_parameter(world):
    """torch takes 0 (it closes a bucket after every parameter); it was refused here."""
    model = distune.DistributedDataParallel(mlp(), bucket_cap_mb=0)
    assert model.hyperparameters == Hyperparameters(0, False)
    assert len(model._reducer.bucket_sizes) == len(list(mlp().parameters()))
    step(model)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"bucket_cap_mb": 1, "bucket_size": 2**20}, ValueError, "not both"),
        ({"bucket_cap_mb": -1}, ValueError, r"number of MiB from 0 .* to 2\*\*28 \(256 TiB"),
        # It named the bucket size in bytes, which the script never gave.
        ({"bucket_cap_mb": 2.0**30}, ValueError, r"bucket_cap_mb must be .* got 1073741824.0"),
        ({"output_device": "cuda:0"}, ValueError, "outputs stay on its device"),
        ({"device_ids": ["cuda:0"]}, ValueError, "device_ids=None for a CPU module"),
        ({"find_unused_parameters": "yes"}, TypeError, "find_unused_parameters must be True"),
        ({"dim": 1.5}, TypeError, "dim must be an int"),
        # What new_group([0]) returns on rank 1: it said "must be a ProcessGroup, got -100".
        (
            {"process_group": dist.GroupMember.NON_GROUP_MEMBER},
            ValueError,
            "this rank is not in process_group: new_group",
        ),
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


def test_two_models_given_one_name_are_refused_at_construction(tuning_world):
    with ScriptedService() as service:
        tuning_world(service.url)
        first = distune.DistributedDataParallel(nn.Linear(64, 8), name="gan")
        with pytest.raises(ModelNameError, match=r"two models are named 'gan'.*own name="):
            distune.DistributedDataParallel(nn.Linear(64, 8), name="gan")
        second = distune.DistributedDataParallel(nn.Linear(64, 8), name="other")
        assert first._sync is not None and second._sync is not None


def test_models_given_no_name_are_numbered_in_construction_order(tuning_world):
    # A torch DDP script wrapping a generator and a discriminator names neither.
    with ScriptedService() as service:
        tuning_world(service.url)
        generator = distune.DistributedDataParallel(nn.Linear(64, 8))
        discriminator = distune.DistributedDataParallel(nn.Linear(8, 1))
        assert (generator.name, discriminator.name) == ("model0", "model1")
        rewrapped = distune.DistributedDataParallel(discriminator.module)  # takes model1 over
        assert rewrapped.name == "model1" and discriminator._sync.stopped

        def registered() -> list[str]:
            return [path for path, _, _ in service.requests if path.endswith("/register")]

        # model0's client may register again meanwhile (it retries a refused answer): on a
        # loaded machine that came before the rewrapped model's registration.
        wait_for(lambda: registered().count("/api/v1/models/model1/register") == 2)
        assert set(registered()) == {f"/api/v1/models/model{k}/register" for k in (0, 1)}
        assert not generator._sync.stopped and not rewrapped._sync.stopped


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


def test_a_second_module_sharing_a_parameter_is_another_model_and_named_in_a_warning(
    tuning_world, caplog
):
    # Tied weights: an encoder and a decoder sharing an embedding, each wrapped. torch's DDP
    # allows it; before, the second took model0 over (it held a parameter of the first) and
    # the first silently stopped tuning.
    with ScriptedService() as service:
        tuning_world(service.url)
        shared = nn.Linear(16, 16)
        with caplog.at_level(logging.WARNING):
            encoder = distune.DistributedDataParallel(nn.Sequential(shared, nn.Linear(16, 4)))
            decoder = distune.DistributedDataParallel(nn.Sequential(shared, nn.Linear(16, 2)))
        assert (encoder.name, decoder.name) == ("model0", "model1")
        assert not encoder._sync.stopped and not decoder._sync.stopped
        warnings = [
            r.getMessage()
            for r in caplog.records
            if r.levelno >= logging.WARNING and "shares parameters" in r.getMessage()
        ]
        assert len(warnings) == 1, "once, on rank 0, for the second wrapper"
        assert warnings[0].startswith(
            "model 'model1' shares parameters with the live DistributedDataParallel 'model0' "
            "of another module (tied weights)"
        )
        tied = distune.DistributedDataParallel(nn.Sequential(shared), name="tied")
        with pytest.raises(ModelNameError, match=r"two models are named 'tied'"):
            distune.DistributedDataParallel(nn.Sequential(shared, nn.ReLU()), name="tied")
        assert not tied._sync.stopped
        assert not encoder._sync.stopped


@pytest.mark.parametrize("dropped", [False, True], ids=["old-kept", "old-dropped"])
def test_a_model_wrapped_again_after_unfreezing_registers_its_new_facts_after_the_old(
    tuning_world, caplog, dropped
):
    # Fine-tuning as the docs say: train the head on a frozen backbone, unfreeze, wrap again.
    # The service tunes the new facts afresh; the old leader's last report, in flight at the
    # re-wrap, reaches it before the new registration (after it, the service would take it for
    # a second model training under the name). Also when the old wrapper was dropped first
    # (``del model``, then ``model = DistributedDataParallel(module)``): before, its claim on
    # the name went with it and the new leader registered at once, under the report in flight.
    done: list[tuple[str, int]] = []
    with ScriptedService() as service:

        def respond(action, body):
            if action == "report":
                time.sleep(0.2)
            elif body["gradient_bytes"] > service.registered[0]:
                service.current = group(2, service.unfrozen)
            service.registered.append(body.get("gradient_bytes", 0))
            done.append((action, body.get("group_id", body.get("gradient_bytes"))))
            return service.normal(action, body)

        module = nn.Sequential(nn.Linear(64, 512), nn.Linear(512, 8))
        head_bytes, all_bytes = 4 * (512 * 8 + 8), 4 * (64 * 512 + 512 + 512 * 8 + 8)
        service.registered, service.respond = [head_bytes], respond
        service.unfrozen = Hyperparameters(17, False)  # in 2^16..2^18, the new space
        service.current = group(1, Hyperparameters(16, False))  # the head's only group
        tuning_world(service.url)
        module[0].requires_grad_(False)
        head = distune.DistributedDataParallel(module)
        train_until(head, lambda: "report" in service.actions())  # one is in flight now
        head_client = head._sync._client
        if dropped:
            del head
        module[0].requires_grad_(True)
        with caplog.at_level(logging.WARNING):
            model = distune.DistributedDataParallel(module)
            train_until(model, lambda: ("report", 2) in done)
            # Read while the service is up: once it stops, a report still in flight warns.
            warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert model.name == "model0" and head_client._stop.is_set()
    assert model.hyperparameters == service.unfrozen, "the new session's group was applied"
    registrations = [i for i, (action, _) in enumerate(done) if action == "register"]
    assert [done[i][1] for i in registrations] == [head_bytes, all_bytes]
    assert ("report", 1) in done[registrations[0] : registrations[1]], "no report was in flight"
    assert ("report", 1) not in done[registrations[1] :]
    assert warned == []


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


# -- torch DDP's arguments, bound against the installed torch's signature -----------------------


@needs_torch_2_13
def test_torch_attributes_have_torch_ddps_values(world):
    module = mlp()
    TorchDDP._set_params_and_buffers_to_ignore_for_model(module, ["1.running_mean"])
    args = {"find_unused_parameters": True, "gradient_as_bucket_view": True, "dim": 1}
    ours, ref = distune.DistributedDataParallel(module, **args), TorchDDP(module, **args)
    for name in (
        "device_ids",
        "output_device",
        "dim",
        "find_unused_parameters",
        "gradient_as_bucket_view",
        "static_graph",
        "broadcast_buffers",
        "forward_sync_buffers",
        "parameters_to_ignore",
        "process_group",
        "require_backward_grad_sync",
    ):
        assert getattr(ours, name) == getattr(ref, name), name
    for model in (ours, ref):
        model._set_static_graph()
        model.broadcast_buffers = False
        assert model.static_graph and not model.forward_sync_buffers


@needs_torch_2_13
@pytest.mark.parametrize(
    ("kwargs", "forward", "construction"),
    [
        ({}, True, True),
        ({"broadcast_buffers": False}, False, False),
        ({"forward_sync_buffers": False}, False, True),
        ({"broadcast_buffers": False, "forward_sync_buffers": True}, True, True),
    ],
)
def test_buffer_broadcasts_follow_torchs_rule(world, kwargs, forward, construction):
    arguments = TorchDDPArguments.bind(mlp(), (), kwargs, [torch.zeros(1)], None)
    assert (arguments.forward_sync_buffers, arguments.init_sync_buffers) == (forward, construction)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch 2.13 deprecates broadcast_buffers
        assert TorchDDP(mlp(), **kwargs).forward_sync_buffers == forward


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        ((), {"bucket_cap": 1}, "unexpected keyword argument 'bucket_cap'"),
        ((None,) * 30, {}, "too many positional arguments"),
        ((None, None, 0), {"dim": 0}, "multiple values for argument 'dim'"),
    ],
)
def test_a_call_torch_refuses_raises_torchs_type_error(world, args, kwargs, message):
    for wrapper in (distune.DistributedDataParallel, TorchDDP):
        with pytest.raises(TypeError):
            wrapper(mlp(), *args, **kwargs)
    with pytest.raises(TypeError, match=message):
        distune.DistributedDataParallel(mlp(), *args, **kwargs)


@needs_torch_2_13
def test_arguments_that_change_the_math_are_refused_by_name(world):
    from torch.nn.parallel.distributed import _MixedPrecision

    with pytest.raises(UnsupportedArgumentError, match=r"mixed_precision=.*torch\.autocast"):
        distune.DistributedDataParallel(mlp(), mixed_precision=_MixedPrecision(torch.bfloat16))
    with pytest.raises(UnsupportedArgumentError, match=r"bucket_cap_mb_list=\[1, 25\].*one size"):
        distune.DistributedDataParallel(mlp(), bucket_cap_mb_list=[1, 25])
    distune.DistributedDataParallel(mlp(), bucket_cap_mb_list=[])  # torch's "uniform"
    distune.DistributedDataParallel(mlp(), mixed_precision=None, skip_all_reduce_unused_params=True)


def test_an_argument_a_newer_torch_adds_is_refused_unless_left_at_its_default(world, monkeypatch):
    def newer_init(self, module, device_ids=None, *, overlap_optimizer=False):  # a future torch
        raise AssertionError("distune never calls torch's constructor")

    monkeypatch.setattr(TorchDDP, "__init__", newer_init)
    distune.DistributedDataParallel(mlp(), overlap_optimizer=False)
    with pytest.raises(UnsupportedArgumentError, match="overlap_optimizer=True is not supported"):
        distune.DistributedDataParallel(mlp(), overlap_optimizer=True)
    with pytest.raises(TypeError, match="unexpected keyword argument 'bucket_cap_mb'"):
        distune.DistributedDataParallel(mlp(), bucket_cap_mb=1)  # not in that torch


@needs_torch_2_13
def test_delayed_allreduce_arguments_follow_torchs_rules(world):
    module = mlp()
    with pytest.raises(ValueError, match="need to be set at the same time"):
        distune.DistributedDataParallel(module, param_to_hook_all_reduce=module[0].weight)
    with pytest.raises(ValueError, match="trainable parameters of the module"):
        distune.DistributedDataParallel(
            module,
            delay_all_reduce_named_params=[("other", nn.Parameter(torch.zeros(1)))],
            param_to_hook_all_reduce=module[0].weight,
        )
    distune.DistributedDataParallel(
        module,
        delay_all_reduce_named_params=[("3.weight", module[3].weight)],
        param_to_hook_all_reduce=module[0].weight,
    )


@needs_torch_2_13
def test_device_mesh_gives_the_process_group_as_in_torch(world):
    mesh = init_device_mesh("cpu", (1,))
    model = distune.DistributedDataParallel(mlp(), device_mesh=mesh)
    assert model.process_group is mesh.get_group(0)
    with pytest.raises(RuntimeError, match="Only 1D device mesh"):
        distune.DistributedDataParallel(mlp(), device_mesh=init_device_mesh("cpu", (1, 1)))
    with pytest.raises(RuntimeError, match="both process_group and device_mesh"):
        distune.DistributedDataParallel(mlp(), process_group=dist.group.WORLD, device_mesh=mesh)


def test_lazy_modules_are_refused_before_their_first_forward(world):
    with pytest.raises(RuntimeError, match=r"uninitialized.*run a forward"):
        distune.DistributedDataParallel(nn.Sequential(nn.LazyLinear(4)))


def test_torchs_ddp_around_the_wrapper_is_refused_unless_it_ignores_its_parameters(world):
    # torch's DDP over distune's (what Accelerate or Lightning do with a wrapped model): both
    # averaged every gradient; on 2 gloo ranks some came out halved, silently.
    outer = TorchDDP(distune.DistributedDataParallel(mlp()))
    with pytest.raises(UnsupportedModuleError, match=r"runs inside torch's Distributed.*\.module"):
        outer(torch.randn(3, 16))
    with torch.no_grad():  # nothing averaged: nothing to refuse
        outer(torch.randn(3, 16))
    # TorchRec's way: the outer DDP ignores the inner wrapper's parameters.
    module = nn.Sequential(distune.DistributedDataParallel(mlp()), nn.Linear(4, 2))
    TorchDDP._set_params_and_buffers_to_ignore_for_model(
        module, [n for n, _ in module.named_parameters() if n.startswith("0.")]
    )
    TorchDDP(module)(torch.randn(3, 16)).sum().backward()


def test_backward_with_create_graph_is_refused_naming_the_way_out(world):
    # torch's DDP fails at the same point with "a leaf Variable that requires grad is being
    # used in an in-place operation", as distune's bucket copy did.
    model = distune.DistributedDataParallel(mlp())
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # autograd's own about create_graph
        with pytest.raises(ReductionError, match=r"create_graph=True.*torch\.autograd\.grad"):
            model(x).pow(2).sum().backward(create_graph=True)


def test_dtensor_parameters_are_refused_naming_torchs_recipe(world):
    # Tensor-parallel (or FSDP2) parameters: the construction broadcast failed in DTensor.
    try:
        from torch.distributed.tensor import Replicate, distribute_tensor
    except ImportError:  # an older torch, where it was private
        from torch.distributed._tensor import Replicate, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    module = mlp()
    module[3].weight = nn.Parameter(
        distribute_tensor(module[3].weight.detach(), mesh, [Replicate()])
    )
    with pytest.raises(UnsupportedModuleError, match=r"'3.weight' is a DTensor.*device_mesh"):
        distune.DistributedDataParallel(module)


def test_modules_on_the_meta_device_are_refused_naming_the_tensors(world):
    # torch's DDP fails too ("Tensor.item() cannot be called on meta tensors"); wrapped, the
    # module was replaced by to_empty() and the next forward raised about added parameters.
    with pytest.raises(UnsupportedModuleError, match=r"\['weight', 'bias'\] are on the meta"):
        distune.DistributedDataParallel(nn.Linear(4, 4, device="meta"))
    module = nn.BatchNorm1d(4)
    module.register_buffer("extra", torch.empty(2, device="meta"))
    with pytest.raises(UnsupportedModuleError, match=r"\['extra'\] .*to_empty\(device="):
        distune.DistributedDataParallel(module)


def test_ignored_parameters_are_not_averaged(world):
    module = mlp()
    TorchDDP._set_params_and_buffers_to_ignore_for_model(module, ["3.weight", "3.bias"])
    model = distune.DistributedDataParallel(module)
    assert {id(p) for p in model._reducer.params} == {
        id(p) for p in (*module[0].parameters(), *module[1].parameters())
    }
    step(model)  # the ignored ones get local gradients, and no "unused parameter" complaint
    assert module[3].weight.grad is not None and model._reducer.iterations == 1


def test_a_parameter_unfrozen_after_wrapping_is_an_error_not_a_local_gradient(world):
    module = mlp()
    module[0].requires_grad_(False)
    model = distune.DistributedDataParallel(module)
    step(model)
    module[0].requires_grad_(True)  # torch's DDP would train it without averaging
    with pytest.raises(ReductionError, match=r"0\.weight, 0\.bias.*unfrozen.*Wrap the module"):
        step(model)


def test_join_refuses_model_averaging_algorithms(world):
    model = distune.DistributedDataParallel(mlp(), algorithm=AsyncModelAverage())
    with pytest.raises(UnsupportedModuleError, match="join\\(\\) cannot shadow AsyncModelAverage"):
        model.join()
    model.finish()


def test_parameters_on_two_devices_are_refused_as_torch_refuses_them(world):
    module = mlp()
    module[3].to("meta")  # the only second device on a CPU machine
    with pytest.raises(ValueError, match=r"cpu.*meta|meta.*cpu"):
        TorchDDP(module)
    with pytest.raises(ValueError, match=r"one device, found \['cpu', 'meta'\]"):
        TorchDDPArguments.bind(module, (), {}, list(module.parameters()), None)
    with pytest.raises(UnsupportedModuleError, match="on the meta device"):  # said first
        distune.DistributedDataParallel(module)


def test_nested_wrappers_are_refused_at_construction(world):
    inner = distune.DistributedDataParallel(mlp(), name="inner")
    with pytest.raises(
        UnsupportedModuleError, match=r"submodule '0' is already a .*DistributedDataParallel"
    ):
        distune.DistributedDataParallel(nn.Sequential(inner, nn.Linear(4, 2)))
    with pytest.raises(
        UnsupportedModuleError, match=r"the module is already a torch\.nn\.parallel"
    ):
        distune.DistributedDataParallel(TorchDDP(mlp()))


def test_replacing_model_module_is_an_error_at_the_next_forward(world):
    model = distune.DistributedDataParallel(mlp())
    step(model)
    model.module = mlp()  # torch's DDP would train it without averaging
    with pytest.raises(ReductionError, match=r"model\.module was replaced.*Wrap the new module"):
        step(model)


def test_hooks_on_the_wrapper_and_train_eval_work_as_on_torchs(world):
    seen: dict[str, list[str]] = {}
    for label, model in (
        ("ours", distune.DistributedDataParallel(mlp())),
        ("torch", TorchDDP(mlp())),
    ):
        calls = seen.setdefault(label, [])
        model.register_forward_pre_hook(lambda m, args, calls=calls: calls.append("pre"))
        model.register_forward_hook(lambda m, args, out, calls=calls: calls.append(str(out.shape)))
        model.eval()
        assert not model.module[1].training
        model.train()
        step(model)
        calls.append(str(model.module[1].training))
    assert seen["ours"] == seen["torch"] == ["pre", "torch.Size([3, 4])", "True"]


def test_two_wrappers_averaging_a_shared_parameter_in_one_backward_are_an_error(world):
    shared = nn.Linear(16, 16)
    first = distune.DistributedDataParallel(nn.Sequential(shared, nn.Linear(16, 4)), name="a")
    second = distune.DistributedDataParallel(nn.Sequential(shared, nn.Linear(16, 2)), name="b")
    x = torch.randn(3, 16)
    with pytest.raises(ReductionError, match=r"'0\.(weight|bias)' is averaged by two .*wrappers"):
        (first(x).sum() + second(x).sum()).backward()


def test_rewrapping_after_training_with_kept_gradients_is_no_sharing(world):
    module = mlp()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    old = distune.DistributedDataParallel(module)
    for model in (old, distune.DistributedDataParallel(module)):  # the old one stays referenced
        optimizer.zero_grad(set_to_none=False)  # .grad stays a view of the old buckets
        step(model)
        optimizer.step()
    assert old._reducer.iterations == 1


@pytest.mark.parametrize("trained", [True, False])
def test_converting_the_model_after_wrapping_is_an_error_not_local_gradients(world, trained):
    model = distune.DistributedDataParallel(mlp())
    if trained:
        step(model)
    model.half()  # also converts each .grad in place, out of its bucket
    with pytest.raises(ReductionError, match=r"torch\.float16 on cpu but was torch\.float32"):
        model(torch.randn(3, 16).half()).sum().backward()


def test_buckets_moved_whole_and_empty_parameters_are_no_conversion(world):
    # share_memory() moves each bucket's storage with all its views; an empty parameter's
    # view has no address of its own. Neither leaves a gradient out of its bucket.
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch: initializing an empty tensor
        module = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 0), nn.Linear(0, 2))
    model = distune.DistributedDataParallel(module)
    x = torch.randn(3, 4)
    model(x).sum().backward()
    model.share_memory()
    model.zero_grad(set_to_none=False)
    model(x).sum().backward()
    reducer = model._reducer
    assert all(p.grad is v for p, v in zip(reducer._params, reducer._views, strict=True))


@pytest.mark.parametrize("set_to_none", [False, True])
def test_a_new_memory_format_after_wrapping_is_an_error_not_local_gradients(world, set_to_none):
    # Same dtype and device: only the .grad's memory moved out of its bucket, so autograd's
    # gradient (or the copy of a fresh one) would have stayed out of the allreduce.
    torch.manual_seed(0)
    model = distune.DistributedDataParallel(nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten()))
    x = torch.randn(2, 3, 5, 5)
    model(x).sum().backward()
    model.to(memory_format=torch.channels_last)
    model.zero_grad(set_to_none=set_to_none)
    with pytest.raises(ReductionError, match=r"'0\.weight' has a new memory layout.*wrap"):
        model(x).sum().backward()


def test_a_second_comm_hook_is_refused_as_torch_refuses_it(world):
    for model in (distune.DistributedDataParallel(mlp()), TorchDDP(mlp())):
        model.register_comm_hook(None, fp16_compress_hook)
        with pytest.raises(RuntimeError, match="can only be called once"):
            model.register_comm_hook(None, allreduce_hook)


def test_a_hook_that_sets_a_cast_buffer_sends_it_as_torchs_ddp_does(world):
    # torch's fp16_compress_wrapper sets an fp16 copy as the bucket's buffer and runs the hook
    # it wraps on it. set_buffer copied it back into the fp32 bucket: the wrapped hook sent
    # fp32, uncompressed, and 2 gloo ranks' weights differed from torch's by 0.087 after 4
    # SGD steps (the sum at another precision). Now the hook sees what torch's sees.
    sent = {}

    def allreduce_recording(state, bucket):
        sent[state] = (bucket.buffer().dtype, [g.dtype for g in bucket.gradients()])
        return allreduce_hook(None, bucket)

    grads = {}
    for name, wrapper in (("distune", distune.DistributedDataParallel), ("torch", TorchDDP)):
        torch.manual_seed(0)
        model = wrapper(mlp())
        model.register_comm_hook(name, fp16_compress_wrapper(allreduce_recording))
        step(model)
        grads[name] = [p.grad.clone() for p in model.module.parameters()]
    parameters = len(list(mlp().parameters()))
    assert sent["distune"] == sent["torch"] == (torch.float16, [torch.float16] * parameters)
    assert all(torch.equal(a, b) for a, b in zip(grads["distune"], grads["torch"], strict=True))


def test_a_backward_reaching_no_parameter_still_averages_but_autograd_grad_does_not(world):
    """A ``backward()`` through the output that reaches no parameter takes part in the
    averaging (with zeros), as the other ranks' backward needs; ``autograd.grad`` through the
    output (a gradient penalty) accumulates nothing and stays out of it, as in torch."""
    model = distune.DistributedDataParallel(mlp())
    x = torch.randn(3, 16, requires_grad=True)
    penalty = torch.autograd.grad(model(x).sum(), x, create_graph=True)[0].square().sum()
    assert model._reducer.iterations == 0
    (penalty + model(x).sum()).backward()
    assert model._reducer.iterations == 1
    model = distune.DistributedDataParallel(UsesNoParameter())
    model(x).sum().backward()
    assert model._reducer.iterations == 1
    assert model.module.weight.grad is None, "unused on every rank: None, as in torch"


class UsesNoParameter(nn.Module):
    """A forward that uses none of the module's parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


def test_a_forward_without_backward_before_an_averaged_one_is_logged_once(world, caplog):
    model = distune.DistributedDataParallel(mlp())
    x = torch.randn(3, 16)
    with caplog.at_level(logging.WARNING, logger="distune.worker_runtime.reducer"):
        for _ in range(2):
            model(x)  # no backward: the ranks' averaging would pair one iteration off
            model(x).sum().backward()
        a, b = model(x), model(x)
        (a + b).sum().backward()
    warnings_logged = [r for r in caplog.records if "had no backward" in r.message]
    assert len(warnings_logged) == 1
    assert "1 forward(s)" in warnings_logged[0].message


class KeepsHidden(nn.Module):
    """Squares a hidden layer (autograd saves it) and keeps a weak reference to it."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(16, 4)
        self.hidden: weakref.ref[torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.layer(x)
        self.hidden = weakref.ref(hidden)
        return hidden * hidden


def test_an_output_dropped_without_backward_frees_its_graph_at_once(world):
    """The hooks on a forward's output hold nothing that refers back to its graph: a forward
    without backward frees its saved tensors by reference counting, not at the next gc."""
    model = distune.DistributedDataParallel(KeepsHidden())
    gc.disable()
    try:
        output = model(torch.randn(3, 16))
        assert model.module.hidden() is not None
        del output
        assert model.module.hidden() is None
    finally:
        gc.enable()


def test_a_trainable_parameter_added_after_wrapping_is_an_error_at_the_next_forward(world):
    """A new head used alongside every old parameter, an adapter set as an attribute: torch's
    DDP trains them unaveraged; here the next forward raises, naming them."""
    model = distune.DistributedDataParallel(mlp())
    step(model)
    unrelated = nn.Linear(2, 2)  # registered elsewhere in the process: no effect
    unrelated.extra = nn.Parameter(torch.ones(1))
    model.module[0].weight = model.module[0].weight  # the same parameter again: fine
    assert not model._reducer._added.changed, "nothing new: no scan at the next forward"
    step(model)
    model.module.add_module("head", nn.Linear(4, 4))
    with pytest.raises(ReductionError, match=r"\(head\.weight, head\.bias\).*added"):
        step(model)

    model = distune.DistributedDataParallel(mlp())
    model.module[3].scale = nn.Parameter(torch.ones(4), requires_grad=False)
    step(model)  # frozen: nothing to average
    model.module[3].scale.requires_grad_(True)
    with pytest.raises(ReductionError, match=r"\(3\.scale\)"):
        step(model)  # raised after the backward that could train it, as for frozen ones

    # A checkpoint loaded with assign=True replaces every parameter (torch's DDP trains the new
    # ones unaveraged: seen on 2 gloo ranks); loaded without, it copies into them.
    model = distune.DistributedDataParallel(mlp())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(state)
    step(model)
    model.load_state_dict(state, assign=True)
    with pytest.raises(ReductionError, match=r"\(0\.weight, 0\.bias.*assign=True"):
        step(model)


@pytest.mark.parametrize("registered", ["before wrapping", "after wrapping"])
def test_an_optimizer_step_in_a_post_accumulate_grad_hook_is_an_error(world, registered):
    # torch's "optimizer in backward" recipe: each parameter steps (and clears .grad) as soon
    # as its gradient is accumulated, before the ranks' average exists; torch's DDP lets it.
    module = mlp()
    optimizers = {p: torch.optim.SGD([p], lr=0.1) for p in module.parameters()}

    def step_now(param: torch.Tensor) -> None:
        optimizers[param].step()
        optimizers[param].zero_grad()

    def register() -> None:
        for p in module.parameters():
            p.register_post_accumulate_grad_hook(step_now)

    if registered == "before wrapping":
        register()
    model = distune.DistributedDataParallel(module)
    if registered == "after wrapping":
        register()
    with pytest.raises(ReductionError, match=rf"hook that ran {registered.split()[0]} distune's"):
        step(model)


def test_a_hook_changing_grad_in_place_is_no_error(world):
    module = mlp()
    model = distune.DistributedDataParallel(module)

    def clip(param: torch.Tensor) -> None:
        param.grad.clamp_(-1, 1)

    for p in module.parameters():
        p.register_post_accumulate_grad_hook(clip)
    step(model)
    assert all(p.grad.abs().max() <= 1 for p in module.parameters())


def test_zero_overlap_hooks_are_refused_at_registration(world, monkeypatch):
    # They reach into torch's reducer (_has_rebuilt_buckets) at the first backward; torch
    # refuses them on gloo itself, so the hook is made as under NCCL.
    from torch.distributed.algorithms.ddp_comm_hooks import ddp_zero_hook
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model = distune.DistributedDataParallel(mlp())
    zero = ZeroRedundancyOptimizer(
        model.parameters(), torch.optim.SGD, lr=0.1, overlap_with_ddp=True
    )
    monkeypatch.setattr(ddp_zero_hook.dist, "get_backend", lambda group: "nccl")
    for make in (ddp_zero_hook.hook_with_zero_step, ddp_zero_hook.hook_with_zero_step_interleaved):
        hook = make(allreduce_hook, model, zero)
        with pytest.raises(UnsupportedModuleError, match="without overlap_with_ddp"):
            model.register_comm_hook(None, hook)


def test_training_through_model_module_is_logged_once(world, caplog):
    # Gradients of a backward through .module stay local, as with torch's DDP; a script that
    # trains through it (a loss method of the inner module) gets one warning saying so.
    module = mlp()
    model = distune.DistributedDataParallel(module)
    old = distune.DistributedDataParallel(mlp())
    rewrapped = distune.DistributedDataParallel(old.module)  # the old wrapper goes inert
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            with model.no_sync():
                step(model)
            step(model)
            step(rewrapped)
        assert not caplog.records, "no_sync and a second wrapper's backward are no news"
        for _ in range(3):
            step(module)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and "parameter '3.bias' without a forward" in messages[0]
    assert "model(x)" in messages[0] and model._reducer.iterations == 2


@pytest.mark.skipif(not hasattr(torch.Tensor, "grad_dtype"), reason="torch < 2.13")
def test_a_grad_dtype_other_than_the_parameters_is_refused_at_construction(world):
    # torch's DDP refuses it at the first backward ("Expected BFloat16, got Float"); distune
    # failed there too, with torch's advice to change grad_dtype.
    module = mlp().to(torch.bfloat16)
    module[0].weight.grad_dtype = torch.float32
    with pytest.raises(UnsupportedModuleError, match=r"'0\.weight' has grad_dtype=torch\.float32"):
        distune.DistributedDataParallel(module)
    module[0].weight.grad_dtype = None  # any dtype: autograd's own is the parameter's
    step(distune.DistributedDataParallel(module.float()))


@pytest.mark.parametrize("algorithm", [None, "Decentralized"])
def test_torchs_in_backward_optimizers_step_once_per_backward(world, algorithm):
    # Taken over (stepped after the reduction) with gradient averaging; left to torch's own
    # hooks under a model-averaging algorithm, whose gradients stay local anyway.
    from torch.distributed.optim import _apply_optimizer_in_backward

    from distune.algorithms import Decentralized

    module = mlp()
    _apply_optimizer_in_backward(torch.optim.SGD, module.parameters(), {"lr": 0.1})
    chosen = Decentralized() if algorithm else None
    model = distune.DistributedDataParallel(module, algorithm=chosen)
    before = [p.detach().clone() for p in module.parameters()]
    step(model)
    assert all(p.grad is None for p in module.parameters())
    assert all(not torch.equal(a, p) for a, p in zip(before, module.parameters(), strict=True))
    assert (model._reducer.after_reduction is None) == bool(algorithm)
    model.finish()


def test_sync_batch_norm_on_cpu_is_refused_at_construction_as_torch_refuses_it(world):
    module = nn.SyncBatchNorm.convert_sync_batchnorm(mlp())
    with pytest.raises(ValueError, match="only work with GPU modules"):
        TorchDDP(module)
    with pytest.raises(UnsupportedModuleError, match=r"submodule '1' is a SyncBatchNorm"):
        distune.DistributedDataParallel(module)


def test_compiled_autograd_is_refused_at_the_forward(world, monkeypatch):
    # Before, the backward failed inside dynamo ("queue_callback() is only supported when
    # Compiled Autograd is enabled with fullgraph=True"); torch's DDP refuses it too.
    import torch._dynamo

    model = distune.DistributedDataParallel(mlp())
    step(model)
    compiling = torch._dynamo.compiled_autograd._enable(torch.compile(backend="eager"))
    with compiling, pytest.raises(ReductionError, match="compiled autograd is on"):
        step(model)
    monkeypatch.setattr(torch._dynamo.config, "compiled_autograd", True)
    with pytest.raises(ReductionError, match="compiled_autograd = False"):
        step(model)
