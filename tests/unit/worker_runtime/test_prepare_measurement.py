"""A level-2 trial of a ``distune.prepare`` script whose steps do not run the trial's
accumulation steps ends as a crash saying so, rather than be measured as a configuration (and
a global batch) it never ran. In a gloo world of one rank, in this process: the trial's
measurement is set to end after more steps than these run."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel

import distune
from distune.trial_settings import ACCUMULATION, MICRO_BATCH, TRIAL_DIR
from distune.worker_runtime.prepare import Prepared, optimizer_state_bytes
from distune.worker_runtime.strategy import StrategyError
from distune.worker_runtime.trial_measurement import TrialStepError


@pytest.fixture
def trial_run(tmp_path, monkeypatch) -> Iterator[Prepared]:
    """``prepare`` in a trial of micro-batch 2 x 4 accumulation steps (the script says 2 x 2)."""
    for name, value in {
        TRIAL_DIR: str(tmp_path),
        MICRO_BATCH: "2",
        ACCUMULATION: "4",
        "DISTUNE_TRIAL_WARMUP_STEPS": "50",
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # the trial installs its report
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    run = distune.prepare(model, optimizer, micro_batch_size=2, gradient_accumulation_steps=2)
    try:
        yield run
    finally:
        assert run.memory is not None
        run.memory.__exit__(None, None, None)  # type: ignore[attr-defined]
        dist.destroy_process_group()


def step(run: Prepared, micro_steps: int, through_accumulate: bool) -> None:
    """One optimizer step of ``micro_steps`` micro-steps of two forwards each (as R-drop)."""
    for i in range(micro_steps):
        with run.accumulate(i) if through_accumulate else contextlib.nullcontext():
            x = torch.randn(run.micro_batch_size, 16)
            (run.model(x).sum() + run.model(x).sum()).backward()
    run.optimizer.step()
    run.optimizer.zero_grad()


@pytest.mark.parametrize("own", [2, 8])
def test_a_script_looping_over_its_own_accumulation_crashes_naming_the_trials(trial_run, own):
    with pytest.raises(TrialStepError) as raised:
        step(trial_run, own, through_accumulate=True)
    ran = ", ".join(map(str, range(own)))
    assert (
        "distune.prepare set gradient_accumulation_steps to 4, but this optimizer step ran "
        f"run.accumulate({ran}): run one micro-step for each i in "
        "range(run.gradient_accumulation_steps)" in str(raised.value)
    )


def test_without_run_accumulate_a_step_of_too_few_forwards_crashes(trial_run):
    with pytest.raises(TrialStepError, match="this optimizer step ran 2 training forward"):
        step(trial_run, 1, through_accumulate=False)


def test_a_step_whose_forwards_bypass_run_model_crashes_rather_than_measure_no_allreduce(
    trial_run,
):
    bare = trial_run.model.module  # the script's own model: its gradients stay local
    for i in range(4):
        with trial_run.accumulate(i):
            bare(torch.randn(2, 16)).sum().backward()
    with pytest.raises(TrialStepError, match=r"ran no training forward through run\.model"):
        trial_run.optimizer.step()


@pytest.mark.parametrize("through_accumulate", [True, False])
def test_the_trials_micro_steps_of_two_forwards_each_pass(trial_run, through_accumulate):
    for _ in range(3):
        step(trial_run, 4, through_accumulate)
        # An evaluation with gradients enabled, in eval mode, is no micro-step.
        trial_run.model.eval()
        trial_run.model(torch.randn(3, 16))
        trial_run.model.train()


@pytest.mark.parametrize(
    ("arguments", "error", "says"),
    [
        (
            {"micro_batch_size": "8"},
            TypeError,
            "micro_batch_size must be a whole number (int) of "
            "at least 1, got '8' (str); a value from a command-line flag needs type=int",
        ),
        ({"micro_batch_size": 8.0}, TypeError, "got 8.0 (float)"),
        ({"micro_batch_size": True}, TypeError, "got True (bool)"),
        (
            {"micro_batch_size": 8, "gradient_accumulation_steps": None},
            TypeError,
            "gradient_accumulation_steps must be a whole number (int) of at least 1, got None",
        ),
        ({"micro_batch_size": 0}, ValueError, "micro_batch_size must be at least 1, got 0"),
        (
            {"micro_batch_size": 8, "blocks": nn.Linear},
            TypeError,
            "blocks must be a sequence of module classes, like blocks=(MyBlock,)",
        ),
    ],
)
def test_prepare_names_a_batch_setting_or_blocks_of_the_wrong_kind(arguments, error, says):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = nn.Linear(4, 4)
        with pytest.raises(error) as raised:
            distune.prepare(model, torch.optim.SGD(model.parameters()), **arguments)
    finally:
        dist.destroy_process_group()
    assert str(raised.value).startswith("distune.prepare: ")
    assert says in str(raised.value)


def test_prepare_takes_a_numpy_style_integer():
    class Index:  # numpy's integers are not int, but have __index__
        def __index__(self) -> int:
            return 3

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = nn.Linear(4, 4)
        run = distune.prepare(model, torch.optim.SGD(model.parameters()), micro_batch_size=Index())
    finally:
        dist.destroy_process_group()
    assert run.micro_batch_size == 3 and type(run.micro_batch_size) is int


def test_a_step_a_gradient_scaler_skips_is_an_iteration_not_a_wrong_accumulation(trial_run):
    # AMP's recipe: an overflow makes scaler.step skip the optimizer's step (fp16 on a GPU
    # does in its first steps; here a scale that overflows float32).
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**120)
    for _ in range(3):
        for i in range(trial_run.gradient_accumulation_steps):
            with trial_run.accumulate(i):
                loss = trial_run.model(torch.randn(trial_run.micro_batch_size, 16)).pow(2).sum()
                scaler.scale(loss * 1e10).backward()
        scaler.step(trial_run.optimizer)
        scaler.update()
        trial_run.optimizer.zero_grad()
    assert scaler.get_scale() == 2.0**117  # all three were skipped
    step(trial_run, 4, through_accumulate=True)  # then one the optimizer takes
    # Each skipped iteration was a step of its own, ended as the next began.
    assert json.loads((Path(os.environ[TRIAL_DIR]) / "progress").read_text()) == {"steps": 4}


@pytest.mark.parametrize("stage", ["0", "1"])
def test_a_scheduler_built_before_prepare_is_refused_where_the_optimizer_is_rebuilt(
    stage, monkeypatch
):
    monkeypatch.setenv("DISTUNE_ZERO_STAGE", stage)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1.0)
        early = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)
        if stage == "1":  # the scheduler would step the old optimizer: the rate stays 1.0
            with pytest.raises(StrategyError, match=r"build the scheduler on run\.optimizer"):
                distune.prepare(model, optimizer, micro_batch_size=2)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1.0)
        run = distune.prepare(model, optimizer, micro_batch_size=2)
        scheduler = (
            early
            if stage == "0"
            else torch.optim.lr_scheduler.LambdaLR(run.optimizer, lambda step: 0.5**step)
        )
        for _ in range(3):
            run.model(torch.randn(2, 4)).sum().backward()
            run.optimizer.step()
            run.optimizer.zero_grad()
            scheduler.step()
        assert run.optimizer.param_groups[0]["lr"] == 0.125
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("stage", ["0", "1", "2"])
def test_stepping_the_optimizer_a_stage_replaced_raises_naming_run_optimizer(stage, monkeypatch):
    # A DDP habit: forwards through run.model, steps through the script's own optimizer. Under
    # ZeRO-1 to 3 that one is replaced: no step was measured (a trial said "invalid: does it
    # call distune.prepare?") and, under FSDP, the sharded model never trained.
    monkeypatch.setenv("DISTUNE_ZERO_STAGE", stage)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        run = distune.prepare(model, optimizer, micro_batch_size=2)
        run.model(torch.randn(2, 4)).sum().backward()
        if stage == "0":  # nothing replaced: the script's own optimizer is run.optimizer
            assert run.optimizer is optimizer
            optimizer.step()
        else:
            with pytest.raises(StrategyError, match=r"call run\.optimizer\.step\(\)"):
                optimizer.step()
            run.optimizer.step()
    finally:
        dist.destroy_process_group()


def test_under_fsdp_the_ddp_idioms_through_model_module_raise_naming_run_model(monkeypatch):
    # With 2 ranks run.model.module's state_dict() held each rank's flattened shards (an
    # 'inp.weight' of shape (81,) for (16, 8)): torch.save of it, DDP's rank-0 idiom, saved
    # no model; a rank-0 evaluation through it failed with "mat2 must be a matrix".
    monkeypatch.setenv("DISTUNE_ZERO_STAGE", "2")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        run = distune.prepare(model, torch.optim.SGD(model.parameters()), micro_batch_size=2)
        run.model(torch.randn(2, 4)).sum().backward()  # through the root: fine
        state = run.model.state_dict()
        run.model.load_state_dict(state)
        for misuse in (
            lambda: run.model.module(torch.randn(2, 4)),
            lambda: run.model.module.state_dict(),
            lambda: run.model.module.load_state_dict(state),
        ):
            with pytest.raises(
                StrategyError, match=r"under ZeRO stage 2 \(FSDP\) run\.model\.module"
            ):
                misuse()
        run.model.eval()
        with torch.no_grad():
            assert run.model(torch.randn(3, 4)).shape == (3, 4)  # the root still runs
        with FullyShardedDataParallel.summon_full_params(run.model):  # whole parameters here
            assert run.model.module.state_dict()["0.weight"].shape == (4, 4)
    finally:
        dist.destroy_process_group()


def test_a_trial_whose_loss_diverged_crashes_rather_than_be_measured(tmp_path, monkeypatch):
    # Two measured steps, no warm-up: the trial reports after the second (a finite model's
    # rank would end there, so only the diverged one runs in this process).
    for name, value in {
        TRIAL_DIR: str(tmp_path),
        MICRO_BATCH: "4",
        ACCUMULATION: "1",
        "DISTUNE_TRIAL_WARMUP_STEPS": "0",
        "DISTUNE_TRIAL_STEPS": "2",
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)

    def measured_as_ok(code: int) -> None:  # a rank ends here once its trial reported ok
        raise AssertionError(f"the trial ended (os._exit({code})) as measured")

    monkeypatch.setattr(os, "_exit", measured_as_ok)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    run = None
    try:
        model = nn.Linear(16, 1)
        run = distune.prepare(
            model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batch_size=2
        )
        run.model(torch.randn(4, 16)).sum().backward()
        run.optimizer.step()  # step 1, finite
        run.optimizer.zero_grad()
        # The loss of this configuration diverges (a sum that overflows at a large micro-batch).
        (run.model(torch.randn(4, 16)).sum() * float("inf")).backward()
        with pytest.raises(TrialStepError, match="the model's parameters hold NaN or inf after "
                           "the trial's 2 steps") as raised:  # fmt: skip
            run.optimizer.step()
        assert not (tmp_path / "result.json").exists()  # nothing measured was reported
        # The rank's report says it diverged, in a field: the search prunes the micro-batch.
        sys.excepthook(raised.type, raised.value, raised.tb)
        report = json.loads((tmp_path / "rank0.json").read_text())
        assert (report["outcome"], report["diverged"]) == ("crash", True)
    finally:
        if run is not None and run.memory is not None:
            run.memory.__exit__(None, None, None)  # type: ignore[attr-defined]
        if dist.is_initialized():
            dist.destroy_process_group()


def test_an_unused_parameters_missing_optimizer_state_is_not_counted_unsharded():
    used, spare = nn.Linear(64, 64), nn.Linear(64, 16)  # the spare never gets a gradient
    optimizer = torch.optim.AdamW([*used.parameters(), *spare.parameters()], lr=0.1)
    used(torch.randn(2, 64)).sum().backward()
    optimizer.step()
    used_bytes = 4 * (64 * 64 + 64)
    trained = used_bytes + 4 * (64 * 16 + 16)  # every trained parameter's bytes
    held = sum(
        v.numel() * v.element_size()
        for state in optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor)
    )
    assert held == 2 * used_bytes + 8  # Adam's two moments of the used Linear, two step counts
    # It used to be scaled to every trained parameter, the spare's missing state included.
    assert optimizer_state_bytes(optimizer, trained, sharded=False) == held
    # A shard's state is scaled to the whole model: the same per byte, over every parameter.
    assert optimizer_state_bytes(optimizer, trained, sharded=True) == round(
        trained * held / used_bytes
    )
