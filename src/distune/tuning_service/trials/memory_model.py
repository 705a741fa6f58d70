"""Predicted peak memory per rank of a level-2 configuration, before launching it.

The ZeRO model of bytes per parameter (parameters ``P``, gradients ``G``, optimizer state ``O``,
all in bytes over the whole model, ``W`` ranks):

==========  =====================================
ddp         P + G + O
zero1       P + G + O / W          (optimizer state sharded)
zero2       P + (G + O) / W        (gradients sharded too)
zero3       (P + G + O) / W + U    (parameters too; ``U`` the largest unsharded block)
==========  =====================================

plus activations, ``A`` bytes per sample of the micro-batch, measured in the profile trial (a
step's peak over what was live when its forward began, per sample: an upper bound, since it
also holds the step's gradient and optimizer temporaries). What the formula misses (gradient
buckets, allocator slack) is the profile's residual, added to every prediction.

Each measured trial then corrects its own (stage, checkpointing) family: one measurement fixes
the family's offset, two or more fit its line in the micro-batch. Checkpointing's activation
bytes come from the profile too: hooks on the repeated blocks measure what each kept and the
bytes of its input, so a checkpointed forward keeps ``A`` minus what the blocks kept plus their
inputs plus one block (recomputed in backward). Without repeated blocks the uncheckpointed
``A`` bounds them from above.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from distune.tuning_service.trials.trial_config import TrialConfig


@dataclass(frozen=True)
class ModelFacts:
    """What the profile trial measured on its ranks (bytes, per rank, before any sharding)."""

    parameter_bytes: int
    gradient_bytes: int
    optimizer_state_bytes: int
    largest_block_bytes: int
    activation_bytes_per_sample: int
    profile: TrialConfig
    profile_peak_bytes: int
    world_size: int
    #: Checkpointed blocks keep their inputs only (and recompute one block at a time); the
    #: profile measures what that leaves per sample. None: unknown, bounded by the above.
    checkpointed_bytes_per_sample: int | None = None

    def state_bytes(self, stage: int) -> float:
        """Parameters, gradients and optimizer state per rank under ZeRO ``stage``."""
        p, g, o, w = (
            self.parameter_bytes,
            self.gradient_bytes,
            self.optimizer_state_bytes,
            self.world_size,
        )
        if stage == 0:
            return p + g + o
        if stage == 1:
            return p + g + o / w
        if stage == 2:
            return p + (g + o) / w
        return (p + g + o) / w + 2 * self.largest_block_bytes  # a block's parameters and grads

    @property
    def residual_bytes(self) -> float:
        """What the formula misses at the profile configuration."""
        profile = self.profile
        return (
            self.profile_peak_bytes
            - self.state_bytes(profile.stage)
            - self.activation_bytes_per_sample * profile.micro_batch
        )


@dataclass
class MemoryModel:
    """Predictions from :class:`ModelFacts`, corrected by every measured trial."""

    facts: ModelFacts
    _measured: dict[tuple[int, bool], dict[int, int]] = field(default_factory=dict)

    def observe(self, config: TrialConfig, peak_bytes: int) -> None:
        """Record a trial's measured peak (a trial that finished its steps)."""
        family = self._measured.setdefault((config.stage, config.checkpointing), {})
        family[config.micro_batch] = max(peak_bytes, family.get(config.micro_batch, 0))

    def _base(self, stage: int) -> float:
        """Predicted bytes of ``stage`` at a micro-batch of zero (no activations)."""
        return self.facts.state_bytes(stage) + self.facts.residual_bytes

    def _slope(self, checkpointing: bool) -> float:
        """Bytes per sample of micro-batch: the profile's, or a checkpointed family's fit."""
        if not checkpointing:
            return float(self.facts.activation_bytes_per_sample)
        slopes = [
            (peak - self._base(stage)) / m
            for (stage, on), family in self._measured.items()
            if on
            for m, peak in family.items()
        ]
        if not slopes:
            measured = self.facts.checkpointed_bytes_per_sample
            if measured is not None:
                return float(min(measured, self.facts.activation_bytes_per_sample))
            return float(self.facts.activation_bytes_per_sample)
        return min(max(max(slopes), 0.0), float(self.facts.activation_bytes_per_sample))

    def predict(self, config: TrialConfig) -> int:
        """Predicted peak bytes per rank of ``config``."""
        family = self._measured.get((config.stage, config.checkpointing), {})
        if len(family) >= 2:
            xs = sorted(family)
            n = len(xs)
            mean_x = sum(xs) / n
            mean_y = sum(family[x] for x in xs) / n
            var = sum((x - mean_x) ** 2 for x in xs)
            slope = sum((x - mean_x) * (family[x] - mean_y) for x in xs) / var
            slope = max(slope, 0.0)
            return round(mean_y + slope * (config.micro_batch - mean_x))
        slope = self._slope(config.checkpointing)
        if family:
            ((m, peak),) = family.items()
            return round(peak + slope * (config.micro_batch - m))
        return round(self._base(config.stage) + slope * config.micro_batch)
