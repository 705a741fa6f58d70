"""A level-2 configuration's data-parallel strategy and activation checkpointing, applied to a
model and its optimizer with torch's own building blocks.

======  ==========================================================================
stage   what wraps the model and the optimizer
======  ==========================================================================
0       distune's :class:`DistributedDataParallel`; the user's optimizer unchanged
1       distune's DDP, the optimizer rebuilt as ``ZeroRedundancyOptimizer`` (state sharded)
2       torch FSDP ``SHARD_GRAD_OP``: gradients and state sharded, parameters kept after forward
3       torch FSDP ``FULL_SHARD``: parameters resharded after forward too
======  ==========================================================================

FSDP wraps each repeated block (the members of a ``ModuleList`` or ``Sequential`` of two or more
modules of one class) as its own unit, so only one block's parameters are gathered at a time.
Activation checkpointing wraps the same blocks with ``checkpoint_wrapper`` (non-reentrant
``torch.utils.checkpoint``): their activations are recomputed in backward instead of kept.
A rebuilt optimizer has the user's class and hyperparameters, group by group; it must be fresh
(no state), as it is when built right before training.

bf16 mixed precision (only where the config allows it: it changes the numerics) runs the
model's forward under ``torch.autocast(dtype=torch.bfloat16)`` under stages 0 and 1, and gives
FSDP a ``MixedPrecision`` of bf16 parameters and buffers with gradients reduced in fp32 under
stages 2 and 3. Either way the parameters the optimizer steps stay fp32, and the forward's
floating-point outputs are returned as fp32, so the script's loss is computed as before.
"""

from __future__ import annotations

import functools
import inspect
import sys
import weakref
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision, ShardingStrategy
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._pytree import tree_map_only

from distune.errors import DistuneError
from distune.worker_runtime.distributed import DistributedDataParallel
from distune.worker_runtime.module_state import broadcast_module_state
from distune.worker_runtime.sharded_state import (
    DEFAULT_CHECKPOINT_TIMEOUT,
    RankCheck,
    check_model,
    whole_fsdp_optimizer,
    whole_zero_optimizer,
)

_SHARDING = {2: ShardingStrategy.SHARD_GRAD_OP, 3: ShardingStrategy.FULL_SHARD}
# FSDP names its wrapped modules' parameters with this prefix; the original names lack it.
_FSDP_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


class StrategyError(DistuneError, ValueError):
    """The model or optimizer cannot take the requested strategy; the message says why."""


@dataclass(frozen=True)
class Applied:
    """The wrapped model and the optimizer to step, as the training loop uses them."""

    model: nn.Module
    optimizer: torch.optim.Optimizer


def repeated_blocks(model: nn.Module) -> tuple[type[nn.Module], ...]:
    """Classes of the model's repeated blocks: those of a ModuleList or Sequential of two or
    more modules, all of one class (a mixed one, embedding, blocks, head, names none)."""
    classes: dict[type[nn.Module], None] = {}
    for module in model.modules():
        if isinstance(module, nn.ModuleList | nn.Sequential):
            children = list(module.children())
            kinds = {type(child) for child in children}
            if len(children) >= 2 and len(kinds) == 1:
                classes[next(iter(kinds))] = None
    return tuple(classes)


def _clean(name: str) -> str:
    for prefix in _FSDP_PREFIXES:
        name = name.replace(prefix, "")
    return name


def _groups_by_name(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[dict]:
    """The optimizer's groups with parameter names instead of parameters."""
    if optimizer.state:
        raise StrategyError(
            "distune.prepare needs a fresh optimizer (no state yet): build it, then prepare, "
            "then train"
        )
    names = {id(p): name for name, p in model.named_parameters()}
    groups = []
    for group in optimizer.param_groups:
        missing = [p for p in group["params"] if id(p) not in names]
        if missing:
            raise StrategyError("the optimizer holds parameters that are not the model's")
        options = {key: value for key, value in group.items() if key != "params"}
        groups.append({"names": [names[id(p)] for p in group["params"]], **options})
    return groups


def _refuse_a_scheduler(optimizer: torch.optim.Optimizer, stage: int) -> None:
    """A stage that rebuilds the optimizer leaves a learning-rate scheduler built on the
    script's own optimizer stepping that one: the rebuilt optimizer's rate would never change.
    torch's schedulers mark every group they take with ``initial_lr``."""
    if any("initial_lr" in group for group in optimizer.param_groups):
        raise StrategyError(
            f"distune.prepare: a learning-rate scheduler was built on the optimizer before "
            f"prepare; ZeRO stage {stage} rebuilds the optimizer, so the scheduler would "
            "step the old one and the learning rate would never change: build the scheduler "
            "on run.optimizer, after distune.prepare"
        )


def _refuse_the_replaced_optimizer(
    _optimizer: Any, _args: Any, _kwargs: Any, *, stage: int
) -> None:
    """A step pre-hook on the optimizer handed to ``prepare`` where a stage replaced it
    (ZeRO-1 to 3): a script that goes on stepping its own optimizer, a DDP habit, would not
    train the model the stage shards (under FSDP its parameters no longer hold the gradients)
    and no step of it would be measured."""
    raise StrategyError(
        "distune.prepare: call run.optimizer.step(), not the step of the optimizer handed to "
        f"prepare: under ZeRO stage {stage} run.optimizer replaces it, and stepping the old one "
        "would not train the sharded model (zero the gradients and build schedulers and "
        "gradient scalers on run.optimizer too)"
    )


class OnlyTheStagesOptimizer:
    """Refuses the step of an optimizer built over the model's parameters after ``prepare``
    (``torch.optim.AdamW(run.model.parameters())``, an FSDP habit) where a stage rebuilt the
    optimizer (ZeRO-1 to 3). It would train, but not as the configuration says: under ZeRO-1
    with the whole optimizer state on every rank (a trial of zero1 measuring ddp's memory and
    time), and under ZeRO-2 and 3 with ``run.optimizer`` left unstepped, so the checkpoint the
    script takes of ``run.optimizer.state_dict()`` holds no state. A global step pre-hook of
    torch's: only weak references to the optimizers and parameters, removed with the stage's
    optimizer; the stage's own inner steps (ZeRO's local optimizer) run inside its step."""

    def __init__(
        self, stage_optimizer: torch.optim.Optimizer, handed: torch.optim.Optimizer, stage: int
    ) -> None:
        self._stage_optimizer = weakref.ref(stage_optimizer)
        self._handed = weakref.ref(handed)  # refused by its own hook, with its own message
        self._parameters = {
            id(p): weakref.ref(p) for g in stage_optimizer.param_groups for p in g["params"]
        }
        self._stage = stage
        self._inside = False

    @classmethod
    def install(
        cls, stage_optimizer: torch.optim.Optimizer, handed: torch.optim.Optimizer, stage: int
    ) -> None:
        """Watch every optimizer step of the process while ``stage_optimizer`` lives."""
        guard = cls(stage_optimizer, handed, stage)
        stage_optimizer.register_step_pre_hook(guard._enter)
        stage_optimizer.register_step_post_hook(guard._leave)
        handle = register_optimizer_step_pre_hook(guard._check)
        weakref.finalize(stage_optimizer, handle.remove)

    def _enter(self, *_: Any) -> None:
        self._inside = True

    def _leave(self, *_: Any) -> None:
        self._inside = False

    def _holds_the_models(self, optimizer: torch.optim.Optimizer) -> bool:
        for group in optimizer.param_groups:
            for p in group["params"]:
                held = self._parameters.get(id(p))
                if held is not None and held() is p:
                    return True
        return False

    def _check(self, optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        if (
            self._inside
            or optimizer is self._stage_optimizer()
            or optimizer is self._handed()
            or not self._holds_the_models(optimizer)
        ):
            return
        without = (
            "every rank keeping the whole optimizer state"
            if self._stage == 1
            else "run.optimizer.state_dict() would hold no state for a checkpoint"
        )
        raise StrategyError(
            f"distune.prepare: call run.optimizer.step(), not the step of another optimizer over "
            f"run.model's parameters: under ZeRO stage {self._stage} run.optimizer is the "
            f"optimizer the stage built, and one built after prepare would train without it "
            f"({without}); build the optimizer before distune.prepare and hand it in"
        )


def _constructor_options(optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's defaults that its constructor takes (some, like AdamW's
    ``decoupled_weight_decay``, are set by the class itself)."""
    accepted = inspect.signature(type(optimizer).__init__).parameters
    return {key: value for key, value in optimizer.defaults.items() if key in accepted}


def _rebuild(
    optimizer: torch.optim.Optimizer, model: nn.Module, groups: list[dict]
) -> torch.optim.Optimizer:
    by_name = {_clean(name): p for name, p in model.named_parameters()}
    param_groups = [
        {"params": [by_name[n] for n in g["names"]], **{k: v for k, v in g.items() if k != "names"}}
        for g in groups
    ]
    return type(optimizer)(param_groups, **_constructor_options(optimizer))


@contextmanager
def _running_statistics_kept(norms: Sequence[nn.Module]) -> Iterator[None]:
    """Leave the batch norms' running statistics as they were before this block (the
    recomputation in backward): the forward already updated them once."""
    kept = [[buffer.clone() for buffer in norm.buffers()] for norm in norms]
    try:
        yield
    finally:
        with torch.no_grad():
            for norm, buffers in zip(norms, kept, strict=True):
                for buffer, before in zip(norm.buffers(), buffers, strict=True):
                    buffer.copy_(before)


def _checkpointed(block: nn.Module) -> nn.Module:
    """``block`` under non-reentrant activation checkpointing. Its recomputation in backward
    runs its forward again, which would update each batch norm's running statistics (and
    ``num_batches_tracked``) a second time, training other statistics than without
    checkpointing; they are kept as the forward left them (a copy of the norms' buffers a
    block a backward; a block without norms is wrapped as it was)."""
    # Batch and instance norms (torch's _NormBase) keep running statistics.
    norms = [m for m in block.modules() if isinstance(m, nn.modules.batchnorm._NormBase)]
    if not norms:
        return checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    return checkpoint_wrapper(
        block,
        checkpoint_impl=CheckpointImpl.NO_REENTRANT,
        context_fn=lambda: (nullcontext(), _running_statistics_kept(norms)),
    )


def _fp32_outputs(model: nn.Module, device: torch.device, autocast: bool) -> None:
    """Make ``model``'s forward return fp32 floating outputs, run under bf16 autocast if
    ``autocast`` (the instance's own ``forward``: parameter names and state dict unchanged)."""
    forward = model.forward

    def run(*args: Any, **kwargs: Any) -> Any:
        context: AbstractContextManager[Any] = (
            torch.autocast(device.type, dtype=torch.bfloat16) if autocast else nullcontext()
        )
        with context:
            outputs = forward(*args, **kwargs)
        return tree_map_only(
            torch.Tensor, lambda t: t.float() if t.is_floating_point() else t, outputs
        )

    model.forward = run


def apply(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    stage: int,
    checkpointing: bool,
    device: torch.device,
    name: str = "model0",
    blocks: Sequence[type[nn.Module]] | None = None,
    bf16: bool = False,
    checkpoint_timeout: float = DEFAULT_CHECKPOINT_TIMEOUT,
) -> Applied:
    """Wrap ``model`` (and rebuild ``optimizer`` where the stage needs it). Under stages 1 to 3
    the state-dict calls that are collectives meet every rank first, for at most
    ``checkpoint_timeout`` seconds, and the optimizer's state dict is the whole state
    (:mod:`distune.worker_runtime.sharded_state`)."""
    block_classes = tuple(blocks) if blocks is not None else repeated_blocks(model)
    if (checkpointing or stage == 3) and not block_classes:
        raise StrategyError(
            f"{'activation checkpointing' if checkpointing else 'ZeRO-3'} needs repeated blocks "
            "(a ModuleList or Sequential of two or more modules, all of one class), or pass "
            "blocks=(YourBlock,) to distune.prepare"
        )
    groups = _groups_by_name(model, optimizer)
    if stage > 0:
        _refuse_a_scheduler(optimizer, stage)
        optimizer.register_step_pre_hook(
            functools.partial(_refuse_the_replaced_optimizer, stage=stage)
        )
    if checkpointing:
        apply_activation_checkpointing(
            model,
            checkpoint_wrapper_fn=_checkpointed,
            check_fn=lambda module: isinstance(module, block_classes),
        )
    device_ids = [device.index] if device.type == "cuda" else None
    if bf16:
        _fp32_outputs(model, device, autocast=stage in (0, 1))
    if stage in (0, 1):
        wrapped: nn.Module = DistributedDataParallel(model, name=name, device_ids=device_ids)
        if stage == 0:
            return Applied(wrapped, optimizer)
        # Each rank's updated shard is broadcast as one tensor, not a parameter at a time (the
        # same values): one-by-one, every rank's shard crosses the link in turn, 2.25 x its
        # line-rate time at 1 gbit/s (BENCHMARKS.md, "zero1's broadcast on the testbed").
        zero = ZeroRedundancyOptimizer(
            [dict(group) for group in optimizer.param_groups],
            optimizer_class=type(optimizer),
            parameters_as_bucket_view=True,
            **_constructor_options(optimizer),
        )
        whole_zero_optimizer(zero, RankCheck.create(stage, checkpoint_timeout), device)
        OnlyTheStagesOptimizer.install(zero, optimizer, stage)
        return Applied(wrapped, zero)
    # Rank 0's parameters and buffers everywhere, as distune's DDP (and torch's) copies them at
    # construction: a script that seeds each rank differently before building its model (timm's
    # random_seed(seed, rank)) would otherwise shard a mix of every rank's initialisation.
    # FSDP's own sync_module_states refuses a model on CPU.
    world = dist.group.WORLD
    assert world is not None  # prepare checked that torch.distributed is initialised
    broadcast_module_state([*model.parameters(), *model.buffers()], world)
    policy = ModuleWrapPolicy(set(block_classes)) if block_classes else None
    wrapped = FullyShardedDataParallel(
        model,
        sharding_strategy=_SHARDING[stage],
        auto_wrap_policy=policy,
        use_orig_params=True,
        device_id=device,
        mixed_precision=MixedPrecision(
            param_dtype=torch.bfloat16,
            reduce_dtype=torch.float32,
            buffer_dtype=torch.bfloat16,
        )
        if bf16
        else None,
    )
    ShardedModuleGuard(wrapped, stage).install()
    rebuilt = _rebuild(optimizer, wrapped, groups)
    check = RankCheck.create(stage, checkpoint_timeout)
    check_model(wrapped, check)
    # The names before wrapping are those FSDP's state dicts use.
    names = [n for g in groups for n in g["names"]]
    whole_fsdp_optimizer(wrapped, rebuilt, check, names, device)
    rebuilt.register_step_pre_hook(functools.partial(_refuse_a_local_grad_scaler, stage=stage))
    OnlyTheStagesOptimizer.install(rebuilt, optimizer, stage)
    return Applied(wrapped, rebuilt)


# torch's GradScaler (torch.amp's since torch 2.3; torch.cuda.amp's before, which the package's
# torch 2.1 and 2.2 have), and where it calls the optimizer's step (its own, or a subclass's).
_GRAD_SCALER: type[torch.amp.GradScaler] = (
    getattr(torch.amp, "GradScaler", None) or torch.cuda.amp.GradScaler
)
_SCALER_STEPS = (_GRAD_SCALER.step.__code__, _GRAD_SCALER._maybe_opt_step.__code__)


def _refuse_a_local_grad_scaler(_optimizer: Any, _args: Any, _kwargs: Any, *, stage: int) -> None:
    """An optimizer step pre-hook under ZeRO-2/3: refuse a step that torch's ``GradScaler``
    takes. Each rank holds a shard of the gradients, and that scaler checks only its own shard
    for inf/NaN, so ranks would skip different steps and train different models (torch's
    ``ShardedGradScaler`` agrees over the ranks). Refused before the first step any rank takes,
    no rank ever applies a step the others skipped. Costs a look at the caller's frames."""
    frame = sys._getframe(1)
    for _ in range(6):  # the scaler calls the step through the optimizer's hook wrapper
        if frame.f_code in _SCALER_STEPS:
            scaler = frame.f_locals.get("self")
            if (
                isinstance(scaler, _GRAD_SCALER)
                and not isinstance(scaler, ShardedGradScaler)
                and scaler.is_enabled()
            ):
                raise StrategyError(
                    f"distune.prepare: under ZeRO stage {stage} (FSDP) each rank holds a shard "
                    "of the gradients, and torch.amp.GradScaler checks only its own rank's "
                    "shard for inf/NaN: ranks would skip different steps and train different "
                    "models. Use torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler "
                    "(the same API; it agrees over the ranks, under every stage), or pin "
                    "zero_optimization.stage to 0 or 1 in the level-2 config"
                )
            return
        if frame.f_back is None:
            return
        frame = frame.f_back


class ShardedModuleGuard:
    """Under zero2 and zero3 ``run.model.module`` (FSDP's wrapped module) holds this rank's
    flattened shards, not the model: the DDP idioms that reach for it (a rank-0 evaluation
    through ``model.module``, ``torch.save(model.module.state_dict())``) would fail cryptically
    ("mat2 must be a matrix") or, worse, save the shards as the model's weights. They raise
    here, naming the way out; FSDP's own calls go through the root (``run.model``), which
    this tells apart (forwards by a flag the root's hooks hold, state dicts by their prefix);
    inside FSDP's ``summon_full_params`` the wrapped module holds whole parameters and is let be."""

    def __init__(self, root: FullyShardedDataParallel, stage: int) -> None:
        self._root = root
        self._stage = stage
        self._in_root_forward = False

    def install(self) -> None:
        """Hook the root and its wrapped module."""
        inner = self._root.module
        self._root.register_forward_pre_hook(self._enter)
        self._root.register_forward_hook(self._leave, always_call=True)
        inner.register_forward_pre_hook(self._check_forward)
        inner.register_state_dict_pre_hook(self._check_state_dict)
        inner.register_load_state_dict_pre_hook(self._check_load)

    def _enter(self, *_: Any) -> None:
        self._in_root_forward = True

    def _leave(self, *_: Any) -> None:
        self._in_root_forward = False

    def _refuse(self, instead: str) -> StrategyError:
        return StrategyError(
            f"distune.prepare: under ZeRO stage {self._stage} (FSDP) run.model.module holds "
            f"this rank's flattened shards of the parameters, not the model: {instead}, or pin "
            "zero_optimization.stage to 0 or 1 in the level-2 config"
        )

    def _gathered(self) -> bool:
        """Inside FSDP's ``summon_full_params``: the wrapped module holds whole parameters."""
        state = getattr(self._root, "training_state", None)
        return getattr(state, "name", None) == "SUMMON_FULL_PARAMS"

    def _check_forward(self, *_: Any) -> None:
        if not self._in_root_forward and not self._gathered():
            raise self._refuse(
                "run every forward through run.model, on every rank (an evaluation too: FSDP "
                "gathers the parameters from all ranks)"
            )

    def _check_state_dict(self, _module: nn.Module, prefix: str, _keep_vars: bool) -> None:
        if not prefix and not self._gathered():  # on run.model.module itself, not the root
            raise self._refuse(
                "its state_dict() would be those shards; save run.model.state_dict() (FSDP "
                "gathers the whole model: call it on every rank)"
            )

    def _check_load(self, _module: nn.Module, _state: Any, prefix: str, *_: Any) -> None:
        if not prefix and not self._gathered():
            raise self._refuse("load a state dict with run.model.load_state_dict()")
