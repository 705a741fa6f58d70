"""``distune.prepare``: how a training script takes a level-2 configuration.

The script builds its model and optimizer as usual and hands them over with its own batch
settings; it gets back the model and optimizer to train with and the micro-batch and
accumulation steps to use. Under ``distune-run --autotune_level 2`` those come from the trial
or from the chosen configuration (``DISTUNE_*``, see :mod:`distune.trial_settings`); without it,
the script's own values hold and the model is wrapped in distune's DDP, so the same script runs
anywhere. In a trial, the steps are measured and the process ends after them.
"""

from __future__ import annotations

import contextlib
import logging
import operator
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel

from distune.trial_settings import TrialSettings
from distune.worker_runtime.memory_cap import MemoryMeter
from distune.worker_runtime.sharded_state import DEFAULT_CHECKPOINT_TIMEOUT
from distune.worker_runtime.strategy import apply, repeated_blocks
from distune.worker_runtime.trial_measurement import (
    PREPARE,
    TrialMeasurement,
    TrialStepError,
    WrapperMeasurement,
    batch_norms,
    install_failure_report,
    measures_trial,
    preparing,
    process_meter,
)

logger = logging.getLogger(__name__)

_STRATEGIES = {0: "ddp", 1: "zero1", 2: "zero2", 3: "zero3"}


@dataclass(frozen=True)
class Prepared:
    """What to train with: the wrapped model, the optimizer to step, and the batch settings."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    micro_batch_size: int
    gradient_accumulation_steps: int
    strategy: str
    activation_checkpointing: bool
    memory: MemoryMeter | None
    #: bf16 mixed precision (only where the config allows it: it changes the numerics).
    bf16: bool = False
    #: In a trial, what checks each step's micro-steps against the trial's accumulation.
    measurement: TrialMeasurement | None = field(default=None, repr=False, compare=False)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients to a total norm of ``max_norm`` over the whole model, as
        ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` does under DDP; returns the
        total norm before clipping. Under ZeRO-2 and ZeRO-3 (FSDP) each rank holds a shard of
        the gradients, and torch's function would clip each shard by its rank's own part of
        the norm: FSDP's ``clip_grad_norm_`` reduces the norm over the ranks first."""
        if isinstance(self.model, FullyShardedDataParallel):
            return self.model.clip_grad_norm_(max_norm, norm_type)
        return nn.utils.clip_grad_norm_(self.model.parameters(), max_norm, norm_type)

    @contextlib.contextmanager
    def accumulate(self, micro_step: int) -> Iterator[None]:
        """Around micro-step ``micro_step`` (0-based) of an optimizer step: gradients are
        averaged over the ranks only in the last one."""
        if self.measurement is not None:
            self.measurement.micro_step(micro_step)
        if micro_step < self.gradient_accumulation_steps - 1:
            with self.model.no_sync():  # type: ignore[operator]
                yield
        else:
            yield


def _bytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _facts(model: nn.Module, blocks: tuple[type[nn.Module], ...]) -> tuple[int, int, int]:
    """Parameter bytes, gradient bytes and the largest repeated block's parameter bytes."""
    params = list(model.parameters())
    largest = max(
        (_bytes(list(m.parameters())) for m in model.modules() if isinstance(m, blocks)),
        default=0,
    )
    return _bytes(params), _bytes([p for p in params if p.requires_grad]), largest


def optimizer_state_bytes(
    optimizer: torch.optim.Optimizer, gradient_bytes: int, sharded: bool
) -> int:
    """The whole model's optimizer state, from this rank's share of it. Unsharded (ddp, the
    profile's usual stage) it is the state as it is: a parameter that never gets a gradient
    (an unused head) gets no state, and scaling the state by every trained parameter's bytes
    counted it as Adam's 2 x its size (a model with a spare Linear a block: 4.2 MB for 2.1 MB
    held), which the memory model then halved away under ZeRO. Sharded (a pinned stage), the
    share's state per byte of its parameters, over every trained parameter's bytes."""
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer keeps its own
    state_bytes = param_bytes = 0
    for param, state in inner.state.items():
        param_bytes += param.numel() * param.element_size()
        state_bytes += sum(
            v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor)
        )
    if not sharded:
        return state_bytes
    return round(gradient_bytes * state_bytes / param_bytes) if param_bytes else 0


def _whole_numbers(micro_batch_size: Any, gradient_accumulation_steps: Any) -> tuple[int, int]:
    """The batch settings as ints; refuse what would fail later, far from the call, or run
    with a batch of 8.0 or True: a flag parsed without ``type=int``, an HF-style ``None``."""
    checked = []
    for name, value in (
        ("micro_batch_size", micro_batch_size),
        ("gradient_accumulation_steps", gradient_accumulation_steps),
    ):
        try:
            number = None if isinstance(value, bool) else operator.index(value)
        except TypeError:
            number = None
        if number is None:
            raise TypeError(
                f"distune.prepare: {name} must be a whole number (int) of at least 1, got "
                f"{value!r} ({type(value).__name__}); a value from a command-line flag needs "
                "type=int"
            )
        if number < 1:
            raise ValueError(f"distune.prepare: {name} must be at least 1, got {number}")
        checked.append(number)
    return checked[0], checked[1]


def _block_classes(blocks: Any, model: nn.Module) -> tuple[type[nn.Module], ...]:
    """``blocks`` as a tuple of module classes (default: the model's repeated blocks)."""
    if blocks is None:
        return repeated_blocks(model)
    if isinstance(blocks, type) or not all(
        isinstance(b, type) and issubclass(b, nn.Module) for b in blocks
    ):
        raise TypeError(
            "distune.prepare: blocks must be a sequence of module classes, like "
            f"blocks=(MyBlock,), got {blocks!r}"
        )
    return tuple(blocks)


def _join_the_trial(trial_dir: Path, rank: int, collective_timeout: int | None) -> None:
    """A rank's part of a trial: its failure report, and a collective time-out of the trial's."""
    install_failure_report(trial_dir, rank)
    if collective_timeout is not None:
        # A peer rank that died (on another node, say) must not hold this one in a
        # collective for torch's default 30 minutes, even if its launcher is gone.
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=collective_timeout))


def _trial_checkpoint_timeout(settings: TrialSettings, checkpoint_timeout: float) -> float:
    """In a trial, a rank-0-only checkpoint call must fail naming itself before the trial's
    watchdog stops it as a `timeout` "hang" (the default 300 s outlasts the trial's 120): the
    collective time-out is twice the trial time-out, so it waits at most half of that."""
    if settings.trial_dir is None or settings.collective_timeout is None:
        return checkpoint_timeout
    return min(checkpoint_timeout, settings.collective_timeout / 4)


def prepare(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    micro_batch_size: int,
    gradient_accumulation_steps: int = 1,
    name: str = "model0",
    blocks: Sequence[type[nn.Module]] | None = None,
    checkpoint_timeout: float = DEFAULT_CHECKPOINT_TIMEOUT,
) -> Prepared:
    """Wrap ``model`` and ``optimizer`` for this run's level-2 configuration.

    Args:
        model: the model, on its device, not wrapped yet.
        optimizer: a fresh optimizer over ``model``'s parameters (rebuilt, same class and
            hyperparameters, where a sharded strategy needs it).
        micro_batch_size: the script's own samples per rank per forward.
        gradient_accumulation_steps: the script's own micro-steps per optimizer step.
        name: the model's name for the tuning service (as for DistributedDataParallel).
        blocks: classes of the model's repeated blocks (default: found in its ModuleLists).
        checkpoint_timeout: seconds every rank waits for the others in the state-dict calls
            that are collectives under a sharded stage (``run.model.state_dict()`` under
            ZeRO-2/3, ``run.optimizer.state_dict()`` under ZeRO-1 to 3, and their loads)
            before failing, naming the call: a rank-0-only call fails then, rather than hang
            until the process group's time-out.

    Returns:
        a :class:`Prepared`: train ``.model`` with ``.optimizer`` on batches of
        ``.micro_batch_size``, stepping every ``.gradient_accumulation_steps`` micro-steps.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("distune.prepare needs torch.distributed to be initialized first")
    micro_batch_size, gradient_accumulation_steps = _whole_numbers(
        micro_batch_size, gradient_accumulation_steps
    )
    block_classes = _block_classes(blocks, model)
    if isinstance(checkpoint_timeout, bool) or not (
        isinstance(checkpoint_timeout, int | float) and checkpoint_timeout > 0
    ):
        raise ValueError(
            "distune.prepare: checkpoint_timeout must be a number of seconds above 0, got "
            f"{checkpoint_timeout!r}"
        )
    settings = TrialSettings.from_env()
    rank = dist.get_rank()
    device = next(model.parameters()).device
    meter = earlier = None
    if settings.is_trial or settings.device_memory is not None:
        tensors = [*model.parameters(), *model.buffers()]
        meter, earlier = process_meter(device, settings.device_memory, tensors)
    if isinstance(earlier, WrapperMeasurement):
        raise TrialStepError(
            "distune trial: distune.prepare was called after another model was wrapped in "
            "distune.DistributedDataParallel: a trial measures the steps of the first model "
            "handed to distune; call distune.prepare first (for every model it tunes), then "
            "wrap the others"
        )
    if settings.trial_dir is not None and earlier is None:
        _join_the_trial(settings.trial_dir, rank, settings.collective_timeout)
    checkpoint_timeout = _trial_checkpoint_timeout(settings, checkpoint_timeout)
    micro = settings.micro_batch or micro_batch_size
    accumulation = settings.accumulation or gradient_accumulation_steps
    stage = settings.stage if settings.stage is not None else 0
    checkpointing = bool(settings.checkpointing)
    bf16 = bool(settings.bf16)
    parameter_bytes, gradient_bytes, largest_block = _facts(model, block_classes)
    norms = batch_norms(model)

    with preparing():  # the DDP made here is measured by prepare, not by itself
        applied = apply(
            model,
            optimizer,
            stage,
            checkpointing,
            device,
            name,
            block_classes,
            bf16,
            checkpoint_timeout,
        )
    prepared = Prepared(
        model=applied.model,
        optimizer=applied.optimizer,
        micro_batch_size=micro,
        gradient_accumulation_steps=accumulation,
        strategy=_STRATEGIES[stage],
        activation_checkpointing=checkpointing,
        memory=meter,
        bf16=bf16,
    )
    if rank == 0:
        logger.info(
            "distune.prepare: %s, micro-batch %d x %d accumulation steps%s%s",
            prepared.strategy,
            micro,
            accumulation,
            ", activation checkpointing" if checkpointing else "",
            ", bf16 mixed precision" if bf16 else "",
        )
    if settings.trial_dir is None:
        return prepared

    def facts() -> dict[str, int]:
        return {
            "parameter_bytes": parameter_bytes,
            "gradient_bytes": gradient_bytes,
            "largest_block_bytes": largest_block,
            "repeated_block_classes": len(block_classes),
            "optimizer_state_bytes": optimizer_state_bytes(
                applied.optimizer, gradient_bytes, sharded=stage > 0
            ),
            "batch_norms": norms,
        }

    if earlier is not None:
        # A second model (a GAN's discriminator): the first one's steps are the trial's.
        earlier.add_model(facts)
        return prepared
    assert meter is not None
    world = dist.get_world_size()

    def describe() -> dict[str, Any]:
        return {
            "api": PREPARE,
            "config": {
                "micro_batch": micro,
                "accumulation": accumulation,
                "stage": stage,
                "checkpointing": checkpointing,
                "bf16": bf16,
            },
            "world_size": world,
            **facts(),
        }

    measurement = TrialMeasurement(
        settings.trial_dir,
        meter,
        samples_per_step=micro * accumulation * world,
        micro_batch=micro,
        warmup=settings.warmup_steps,
        measured=settings.measured_steps,
        device=device,
        describe=describe,
        accumulation=accumulation,
    )
    measurement.attach(applied.model, applied.optimizer, block_classes)
    measures_trial(measurement)
    return replace(prepared, measurement=measurement)
