"""The configurations level 2 may try, given the user's pins and the global batch.

The global batch (samples per optimizer step over all ranks) is a hard constraint: each rank's
share is split into micro-batch x accumulation steps, so only divisors of it are candidates.
``allow_batch_change`` lifts it: micro-batches then run over powers of two (and the script's
own value) with the accumulation steps kept, and the trial record says which global batch each
configuration trains with.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from distune.tuning_service.trials.trial_config import (
    ACCUMULATION,
    GLOBAL_BATCH,
    MICRO_BATCH,
    STRATEGY_NAMES,
    TrialConfig,
    TrialConfigError,
    TrialPins,
)

#: With the batch free, micro-batches go up to this multiple of the script's per-rank batch.
BATCH_CHANGE_REACH = 4


@dataclass(frozen=True)
class TrialSpace:
    """Candidates for one job: ``baseline`` is what the script runs on its own (the profile)."""

    pins: TrialPins
    world_size: int
    baseline: TrialConfig
    allow_batch_change: bool = False
    #: False where the profile found no repeated blocks in the model: ZeRO-3 and activation
    #: checkpointing wrap those blocks, so a trial of either could only crash.
    repeated_blocks: bool = True

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise TrialConfigError(f"world size must be at least 1, got {self.world_size}")
        pins = self.pins
        if (
            pins.global_batch is not None
            and pins.micro_batch is not None
            and pins.accumulation is not None
            and pins.micro_batch * pins.accumulation * self.world_size != pins.global_batch
        ):
            raise TrialConfigError(
                f"{GLOBAL_BATCH} {pins.global_batch} is not {MICRO_BATCH} {pins.micro_batch} x "
                f"{ACCUMULATION} {pins.accumulation} x {self.world_size} ranks"
            )
        if not self.allow_batch_change and self.global_batch % self.world_size:
            lower = self.global_batch - self.global_batch % self.world_size
            nearest = " or ".join(str(n) for n in (lower, lower + self.world_size) if n > 0)
            raise TrialConfigError(
                f"{GLOBAL_BATCH} {self.global_batch} does not divide among {self.world_size} "
                f"ranks; the nearest that do: {nearest}"
            )
        if not self.micro_batches():
            per_rank = self.global_batch // self.world_size
            splits = [f"{m} x {per_rank // m}" for m in range(1, per_rank + 1) if per_rank % m == 0]
            raise TrialConfigError(
                f"no micro-batch x accumulation gives {GLOBAL_BATCH} {self.global_batch} on "
                f"{self.world_size} ranks with the pinned values {self.pins.pinned()}: each "
                f"rank's {per_rank} samples split only as {', '.join(splits[:8])}"
                f"{' ...' if len(splits) > 8 else ''}; unpin one or pass "
                "--autotune_allow_batch_change"
            )

    @property
    def global_batch(self) -> int:
        """The global batch every trial keeps (unless the batch may change)."""
        pins = self.pins
        if pins.global_batch is not None:
            return pins.global_batch
        if pins.micro_batch is not None and pins.accumulation is not None:
            return pins.micro_batch * pins.accumulation * self.world_size
        return self.baseline.global_batch(self.world_size)

    def stages(self) -> tuple[int, ...]:
        """ZeRO stages to try, cheapest communication first."""
        if self.pins.stage is not None:
            return (self.pins.stage,)
        return tuple(s for s in STRATEGY_NAMES if self.repeated_blocks or s != 3)

    def checkpointing(self) -> tuple[bool, ...]:
        """Activation checkpointing settings to try, off (no recomputation) first."""
        pinned = self.pins.checkpointing
        if pinned is not None:
            return (pinned,)
        return (False, True) if self.repeated_blocks else (False,)

    def untried_for_want_of_blocks(self) -> tuple[str, ...]:
        """The knobs the pins left free that the model's lack of repeated blocks takes out
        (``ZeRO-3``, ``activation checkpointing``): what a user could still get by naming the
        blocks. Empty where the model has blocks or the user pinned both knobs."""
        with_blocks = replace(self, repeated_blocks=True)
        lost = (
            ("ZeRO-3", self.stages() != with_blocks.stages()),
            ("activation checkpointing", self.checkpointing() != with_blocks.checkpointing()),
        )
        return tuple(name for name, gone in lost if gone)

    def precisions(self) -> tuple[bool, ...]:
        """bf16 mixed precision off and on where the config allows it (``auto``), off first
        (the numerics the script was written for); else only the pinned or default value."""
        pinned = self.pins.bf16
        return (pinned,) if pinned is not None else (False, True)

    def micro_batches(self) -> tuple[int, ...]:
        """Candidate micro-batches per rank, ascending."""
        pins = self.pins
        if self.allow_batch_change:
            if pins.micro_batch is not None:
                return (pins.micro_batch,)
            per_rank = self.global_batch // self.world_size if self.global_batch else 1
            top = BATCH_CHANGE_REACH * max(self.baseline.micro_batch, per_rank, 1)
            powers = {2**k for k in range(top.bit_length()) if 2**k <= top}
            return tuple(sorted(powers | {self.baseline.micro_batch}))
        per_rank = self.global_batch // self.world_size
        return tuple(
            m
            for m in range(1, per_rank + 1)
            if per_rank % m == 0
            and (pins.micro_batch is None or m == pins.micro_batch)
            and (pins.accumulation is None or per_rank // m == pins.accumulation)
        )

    def accumulation_for(self, micro_batch: int) -> int:
        """Accumulation steps with ``micro_batch``: the global batch's, or the kept one."""
        if self.allow_batch_change:
            return self.pins.accumulation or self.baseline.accumulation
        return self.global_batch // self.world_size // micro_batch

    def config(
        self, stage: int, checkpointing: bool, micro_batch: int, bf16: bool = False
    ) -> TrialConfig:
        """The configuration with these knobs (accumulation follows from the batch rule)."""
        return TrialConfig(
            micro_batch, self.accumulation_for(micro_batch), stage, checkpointing, bf16
        )

    def contains(self, config: TrialConfig) -> bool:
        """Whether ``config`` respects every pin and the batch rule."""
        return (
            config.stage in self.stages()
            and config.checkpointing in self.checkpointing()
            and config.bf16 in self.precisions()
            and config.micro_batch in self.micro_batches()
            and config.accumulation == self.accumulation_for(config.micro_batch)
        )

    def batch_change(self, config: TrialConfig) -> str | None:
        """What changed in the global batch under ``config``, or None when nothing did."""
        new = config.global_batch(self.world_size)
        old = self.baseline.global_batch(self.world_size)
        if new == old:
            return None
        return f"global batch {old} -> {new} (--autotune_allow_batch_change)"
