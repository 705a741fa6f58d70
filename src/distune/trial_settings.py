"""The ``DISTUNE_*`` variables of a level-2 trial (and of the run that keeps its winner).

The launcher writes them (:meth:`TrialSettings.to_env`); ``distune.prepare`` reads them
(:meth:`TrialSettings.from_env`) in every rank. An unset knob means "the script's own value".
``DISTUNE_TRIAL_DIR`` marks a trial: its ranks measure a few steps, write their results there
and end. Like ``worker_settings``, this module imports neither torch nor the service.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from distune.errors import DistuneError

MICRO_BATCH = "DISTUNE_MICRO_BATCH"
ACCUMULATION = "DISTUNE_ACCUMULATION"
ZERO_STAGE = "DISTUNE_ZERO_STAGE"
CHECKPOINTING = "DISTUNE_CHECKPOINTING"
BF16 = "DISTUNE_BF16"
DEVICE_MEMORY = "DISTUNE_DEVICE_MEMORY"
TRIAL_DIR = "DISTUNE_TRIAL_DIR"
WARMUP_STEPS = "DISTUNE_TRIAL_WARMUP_STEPS"
MEASURED_STEPS = "DISTUNE_TRIAL_STEPS"
COLLECTIVE_TIMEOUT = "DISTUNE_TRIAL_COLLECTIVE_TIMEOUT"

#: In a trial's directory: rank 0's aggregated result (each rank's own is ``rank<R>.json``),
#: and the finished steps each node's first rank rewrites for its node launcher's watchdog.
RESULT_FILE = "result.json"
PROGRESS_FILE = "progress"

#: Every variable, with what it means, as the README lists them.
VARIABLES = {
    MICRO_BATCH: "level 2: micro-batch per rank (samples per forward)",
    ACCUMULATION: "level 2: gradient accumulation steps per optimizer step",
    ZERO_STAGE: "level 2: 0 = DDP, 1 = ZeRO-1, 2 = FSDP SHARD_GRAD_OP, 3 = FSDP FULL_SHARD",
    CHECKPOINTING: "level 2: activation checkpointing of repeated blocks (1) or not (0)",
    BF16: "level 2: bf16 mixed precision (1: autocast, or FSDP's MixedPrecision) or not (0)",
    DEVICE_MEMORY: "cap on each rank's live tensor bytes; over it a step raises OutOfMemoryError",
    TRIAL_DIR: "level 2: this run is a trial; its ranks write results here and end",
    WARMUP_STEPS: "level 2: optimizer steps a trial runs before measuring (default 2)",
    MEASURED_STEPS: "level 2: optimizer steps a trial measures (default 5)",
    COLLECTIVE_TIMEOUT: "level 2: seconds a trial's collective waits for a peer rank, then fails",
}


class TrialSettingsError(DistuneError, ValueError):
    """A level-2 ``DISTUNE_*`` variable holds a value it may not; the message names it."""


@dataclass(frozen=True)
class TrialSettings:
    """What the launcher fixed for this run's ranks; ``None`` leaves the script's own value."""

    micro_batch: int | None = None
    accumulation: int | None = None
    stage: int | None = None
    checkpointing: bool | None = None
    device_memory: int | None = None
    trial_dir: Path | None = None
    warmup_steps: int = 2
    measured_steps: int = 5
    bf16: bool | None = None
    collective_timeout: int | None = None

    def __post_init__(self) -> None:
        for name, value, low in (
            (MICRO_BATCH, self.micro_batch, 1),
            (ACCUMULATION, self.accumulation, 1),
            (DEVICE_MEMORY, self.device_memory, 1),
            (WARMUP_STEPS, self.warmup_steps, 0),
            (MEASURED_STEPS, self.measured_steps, 2),
            (COLLECTIVE_TIMEOUT, self.collective_timeout, 1),
        ):
            if value is not None and value < low:
                raise TrialSettingsError(f"{name} must be at least {low}, got {value}")
        if self.stage is not None and self.stage not in (0, 1, 2, 3):
            raise TrialSettingsError(f"{ZERO_STAGE} must be 0, 1, 2 or 3, got {self.stage}")

    @property
    def is_trial(self) -> bool:
        """Whether this run is a level-2 trial (measure, report, end)."""
        return self.trial_dir is not None

    def to_env(self) -> dict[str, str]:
        """The variables to add to the ranks' environment (unset values omitted)."""
        values = {
            MICRO_BATCH: self.micro_batch,
            ACCUMULATION: self.accumulation,
            ZERO_STAGE: self.stage,
            CHECKPOINTING: None if self.checkpointing is None else int(self.checkpointing),
            BF16: None if self.bf16 is None else int(self.bf16),
            DEVICE_MEMORY: self.device_memory,
            TRIAL_DIR: self.trial_dir,
        }
        env = {name: str(value) for name, value in values.items() if value is not None}
        if self.is_trial:
            env[WARMUP_STEPS] = str(self.warmup_steps)
            env[MEASURED_STEPS] = str(self.measured_steps)
            if self.collective_timeout is not None:
                env[COLLECTIVE_TIMEOUT] = str(self.collective_timeout)
        return env

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> TrialSettings:
        """Read the settings from ``environ`` (default: this process's environment)."""
        environ = os.environ if environ is None else environ
        defaults = cls()
        checkpointing = _switch(environ, CHECKPOINTING)
        bf16 = _switch(environ, BF16)
        trial_dir = environ.get(TRIAL_DIR, "").strip()
        return cls(
            micro_batch=_int(environ, MICRO_BATCH),
            accumulation=_int(environ, ACCUMULATION),
            stage=_int(environ, ZERO_STAGE),
            checkpointing=checkpointing,
            device_memory=_int(environ, DEVICE_MEMORY),
            bf16=bf16,
            trial_dir=Path(trial_dir) if trial_dir else None,
            warmup_steps=_or(_int(environ, WARMUP_STEPS), defaults.warmup_steps),
            measured_steps=_or(_int(environ, MEASURED_STEPS), defaults.measured_steps),
            collective_timeout=_int(environ, COLLECTIVE_TIMEOUT),
        )


def _int(environ: Mapping[str, str], name: str) -> int | None:
    text = environ.get(name, "").strip()
    if not text:
        return None
    try:
        return int(text)
    except ValueError:
        raise TrialSettingsError(f"{name} must be an integer, got {text!r}") from None


def _switch(environ: Mapping[str, str], name: str) -> bool | None:
    value = _int(environ, name)
    if value not in (None, 0, 1):
        raise TrialSettingsError(f"{name} must be 0 or 1, got {value}")
    return None if value is None else bool(value)


def _or(value: int | None, default: int) -> int:
    return default if value is None else value
