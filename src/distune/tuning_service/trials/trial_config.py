"""One level-2 configuration and the user's pinned values, in DeepSpeed's config key names.

A configuration is what a trial runs: micro-batch per rank, gradient accumulation steps, ZeRO
stage (0 = distune's DDP), activation checkpointing and bf16 mixed precision. The user pins any
of them with the same keys in ``--autotune_config``; a pinned value is never changed by the
search. Mixed precision changes the numerics, so it is tried only where the config allows it,
as DeepSpeed's ``bf16`` section says it: ``bf16: {enabled: auto}`` lets distune try it,
``enabled: true`` pins it on, ``false`` or no ``bf16`` section never uses it. A batch key
set to ``auto`` (a DeepSpeed config for Hugging Face's Trainer) is not pinned.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from distune.errors import ConfigError

MICRO_BATCH = "train_micro_batch_size_per_gpu"
ACCUMULATION = "gradient_accumulation_steps"
GLOBAL_BATCH = "train_batch_size"
ZERO = "zero_optimization"
CHECKPOINTING = "activation_checkpointing"
ARG_MAPPINGS = "arg_mappings"
BF16 = "bf16"
#: ``bf16: {enabled: auto}``: distune may try bf16 mixed precision.
AUTO = "auto"

#: Every level-2 key a config file may hold.
CONFIG_KEYS = frozenset(
    {MICRO_BATCH, ACCUMULATION, GLOBAL_BATCH, ZERO, CHECKPOINTING, ARG_MAPPINGS, BF16}
)
#: The keys ``arg_mappings`` may map to a script's own flags.
MAPPABLE_KEYS = frozenset({MICRO_BATCH, ACCUMULATION})

#: ZeRO stage -> the name used in logs and in the summary.
STRATEGY_NAMES = {0: "ddp", 1: "zero1", 2: "zero2", 3: "zero3"}


class TrialConfigError(ConfigError):
    """A level-2 config key holds a value it may not; the message names it and what is allowed."""


@dataclass(frozen=True, order=True)
class TrialConfig:
    """What one trial runs on every rank."""

    micro_batch: int
    accumulation: int
    stage: int
    checkpointing: bool
    #: bf16 mixed precision (autocast under ddp/zero1, FSDP's MixedPrecision under zero2/3).
    bf16: bool = False

    def __post_init__(self) -> None:
        if self.micro_batch < 1 or self.accumulation < 1:
            raise TrialConfigError(
                f"micro-batch and accumulation must be at least 1, got {self.micro_batch} "
                f"and {self.accumulation}"
            )
        if self.stage not in STRATEGY_NAMES:
            raise TrialConfigError(f"ZeRO stage must be 0, 1, 2 or 3, got {self.stage}")

    @property
    def strategy(self) -> str:
        """``ddp``, ``zero1``, ``zero2`` or ``zero3``."""
        return STRATEGY_NAMES[self.stage]

    def global_batch(self, world_size: int) -> int:
        """Samples per optimizer step over all ranks."""
        return self.micro_batch * self.accumulation * world_size

    def describe(self) -> str:
        """A short human-readable form for progress lines and the summary."""
        checkpointing = ", checkpointing" if self.checkpointing else ""
        bf16 = ", bf16" if self.bf16 else ""
        return (
            f"{self.strategy}, micro-batch {self.micro_batch} x {self.accumulation}"
            f"{checkpointing}{bf16}"
        )

    def to_config(self, world_size: int) -> dict[str, Any]:
        """The configuration as config-file keys (a ``best_config.json`` holds these)."""
        return {
            MICRO_BATCH: self.micro_batch,
            ACCUMULATION: self.accumulation,
            GLOBAL_BATCH: self.global_batch(world_size),
            ZERO: {"stage": self.stage},
            CHECKPOINTING: self.checkpointing,
            BF16: {"enabled": self.bf16},
        }

    @classmethod
    def from_config(cls, data: Mapping[str, Any]) -> TrialConfig:
        """The inverse of :meth:`to_config` (every key required but ``bf16``: off if absent)."""
        pins = TrialPins.from_config(data)
        if None in (pins.micro_batch, pins.accumulation, pins.stage, pins.checkpointing) or (
            pins.bf16 is None
        ):
            raise TrialConfigError(
                f"a trial configuration needs {MICRO_BATCH}, {ACCUMULATION}, {ZERO}.stage and "
                f"{CHECKPOINTING} (and {BF16} on or off, not {AUTO}), got {sorted(data)}"
            )
        return cls(
            pins.micro_batch,  # type: ignore[arg-type]
            pins.accumulation,  # type: ignore[arg-type]
            pins.stage,  # type: ignore[arg-type]
            pins.checkpointing,  # type: ignore[arg-type]
            pins.bf16,
        )


def _batch_knob(data: Mapping[str, Any], key: str) -> int | None:
    """A batch key's pinned value; None where it is absent or ``auto`` (as a DeepSpeed config
    for Hugging Face's Trainer says "fill it in": distune chooses it)."""
    value = data.get(key)
    if value is None or (isinstance(value, str) and value.strip().lower() == AUTO):
        return None
    return _positive_int(key, value)


def _positive_int(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise TrialConfigError(f"{key} must be a whole number of at least 1, got {value!r}")
    try:
        number = int(str(value).strip())
    except ValueError:
        number = 0
    if number < 1:
        raise TrialConfigError(f"{key} must be a whole number of at least 1, got {value!r}")
    return number


def _stage(value: Any) -> int:
    stage = value.get("stage") if isinstance(value, Mapping) else None
    if isinstance(stage, bool) or stage not in STRATEGY_NAMES:
        raise TrialConfigError(
            f"{ZERO} must be a mapping with stage 0, 1, 2 or 3 (0 = DDP), got {value!r}"
        )
    others = sorted(str(key) for key in value if key != "stage")
    if others:
        # Ignoring them would silently drop what the user asked for (an offload, above all).
        raise TrialConfigError(
            f"{ZERO} takes only stage (ddp, torch's ZeroRedundancyOptimizer or FSDP), got "
            f"{', '.join(others)}: DeepSpeed's other ZeRO options, CPU or NVMe offload among "
            "them, are not distune's; remove them"
        )
    return int(stage)


def _checkpointing(value: Any) -> bool:
    # DeepSpeed's section is a mapping of options; its presence with `enabled` (or a bool) pins it.
    if isinstance(value, Mapping) and isinstance(value.get("enabled"), bool):
        return bool(value["enabled"])
    if isinstance(value, bool):
        return value
    raise TrialConfigError(
        f"{CHECKPOINTING} must be true, false or a mapping with enabled: true|false, got {value!r}"
    )


def _bf16(value: Any) -> bool | None:
    """DeepSpeed's ``bf16`` section: ``{enabled: true|false|auto}`` (or the bare value);
    ``None`` for ``auto`` (distune may try it)."""
    enabled = value.get("enabled") if isinstance(value, Mapping) else value
    if isinstance(enabled, bool):
        return enabled
    if isinstance(enabled, str) and enabled.strip().lower() == AUTO:
        return None
    raise TrialConfigError(
        f"{BF16} must be a mapping with enabled: true, false or {AUTO} (true pins bf16 mixed "
        f"precision on, {AUTO} lets distune try it, false never), got {value!r}"
    )


def _arg_mappings(value: Any) -> dict[str, str]:
    if not isinstance(value, Mapping):
        raise TrialConfigError(f"{ARG_MAPPINGS} must be a mapping of keys to flags, got {value!r}")
    mappings: dict[str, str] = {}
    for key, flag in value.items():
        if key not in MAPPABLE_KEYS:
            raise TrialConfigError(
                f"{ARG_MAPPINGS}: cannot map {key!r}; allowed: {', '.join(sorted(MAPPABLE_KEYS))}"
            )
        if not isinstance(flag, str) or not flag.startswith("-") or any(c.isspace() for c in flag):
            raise TrialConfigError(
                f"{ARG_MAPPINGS}: {key} must map to one of the script's flags like "
                f"--batch_size, got {flag!r}"
            )
        mappings[key] = flag
    if len(set(mappings.values())) < len(mappings):
        raise TrialConfigError(
            f"{ARG_MAPPINGS}: {' and '.join(sorted(mappings))} map to the same flag "
            f"{next(iter(mappings.values()))}; each needs a flag of its own"
        )
    return mappings


@dataclass(frozen=True)
class TrialPins:
    """What the user fixed; ``None`` means distune chooses it."""

    micro_batch: int | None = None
    accumulation: int | None = None
    global_batch: int | None = None
    stage: int | None = None
    checkpointing: bool | None = None
    arg_mappings: tuple[tuple[str, str], ...] = ()
    #: Mixed precision changes the numerics: off unless the config allows it (None: ``auto``).
    bf16: bool | None = False

    @classmethod
    def from_config(cls, data: Mapping[str, Any]) -> TrialPins:
        """The level-2 keys of a config mapping, validated; other keys are ignored."""
        return cls(
            micro_batch=_batch_knob(data, MICRO_BATCH),
            accumulation=_batch_knob(data, ACCUMULATION),
            global_batch=_batch_knob(data, GLOBAL_BATCH),
            stage=_stage(data[ZERO]) if ZERO in data else None,
            checkpointing=_checkpointing(data[CHECKPOINTING]) if CHECKPOINTING in data else None,
            arg_mappings=tuple(sorted(_arg_mappings(data.get(ARG_MAPPINGS, {})).items())),
            bf16=_bf16(data[BF16]) if BF16 in data else False,
        )

    def flag_for(self, key: str) -> str | None:
        """The script's own flag that takes ``key``, if the user mapped one."""
        return dict(self.arg_mappings).get(key)

    def pinned(self) -> dict[str, Any]:
        """The pinned keys with their values (for the log and the summary)."""
        values = {
            MICRO_BATCH: self.micro_batch,
            ACCUMULATION: self.accumulation,
            GLOBAL_BATCH: self.global_batch,
            ZERO: None if self.stage is None else {"stage": self.stage},
            CHECKPOINTING: self.checkpointing,
            # Off is the default, not a choice to report; auto is no pin.
            BF16: {"enabled": True} if self.bf16 else None,
        }
        return {key: value for key, value in values.items() if value is not None}
