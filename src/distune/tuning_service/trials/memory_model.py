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

Without gradient accumulation (one micro-batch a step) gradients and the forward's activations
never all live at once: the optimizer's ``zero_grad`` frees the gradients before the forward,
and backward frees activations as it makes gradients, so about half of ``G`` overlaps the
activations under ddp, zero1 and zero2 (which keeps whole parameters through backward);
zero3 keeps unsharded gradients between micro-steps only while accumulating (FSDP's
``no_sync``) and reshards each block after its backward, so none of ``G`` remains. The model takes
that share of ``G`` off a configuration without accumulation (and adds it back to the
residual when the profile ran without). Measured on two grids (``docs/level2.md``): without it
the model overestimated every configuration without accumulation, by up to 26 %.

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

    def unaccumulated_bytes(self, config: TrialConfig) -> float:
        """Gradient bytes that ``config`` does not hold at its peak for lack of accumulation
        (0 with accumulation): half of them under ddp, zero1 and zero2, all under zero3."""
        if config.accumulation > 1:
            return 0.0
        return self.gradient_bytes * (1.0 if config.stage == 3 else 0.5)

    def formula_bytes(self, config: TrialConfig, activation_bytes_per_sample: float) -> float:
        """The model's peak of ``config`` without the residual, for a given activation slope."""
        return (
            self.state_bytes(config.stage)
            + activation_bytes_per_sample * config.micro_batch
            - self.unaccumulated_bytes(config)
        )

    @property
    def residual_bytes(self) -> float:
        """What the formula misses at the profile configuration."""
        return self.profile_peak_bytes - self.formula_bytes(
            self.profile, self.activation_bytes_per_sample
        )


@dataclass
class MemoryModel:
    """Predictions from :class:`ModelFacts`, corrected by every measured trial."""

    facts: ModelFacts
    _measured: dict[tuple[int, bool], dict[TrialConfig, int]] = field(default_factory=dict)

    def observe(self, config: TrialConfig, peak_bytes: int) -> None:
        """Record a trial's measured peak (a trial that finished its steps)."""
        family = self._measured.setdefault((config.stage, config.checkpointing), {})
        family[config] = max(peak_bytes, family.get(config, 0))

    def _base(self, config: TrialConfig) -> float:
        """Predicted bytes of ``config`` less its activations."""
        return self.facts.formula_bytes(config, 0.0) + self.facts.residual_bytes

    def _slope(self, checkpointing: bool) -> float:
        """Bytes per sample of micro-batch: the profile's, or a checkpointed family's fit."""
        if not checkpointing:
            return float(self.facts.activation_bytes_per_sample)
        slopes = [
            (peak - self._base(config)) / config.micro_batch
            for (_, on), family in self._measured.items()
            if on
            for config, peak in family.items()
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
        # Measurements less the base at their micro-batch: the family's activations and offset.
        points = {c.micro_batch: peak - self._base(c) for c, peak in family.items()}
        base = self._base(config)
        if len(points) >= 2:
            xs = sorted(points)
            n = len(xs)
            mean_x = sum(xs) / n
            mean_y = sum(points[x] for x in xs) / n
            var = sum((x - mean_x) ** 2 for x in xs)
            slope = sum((x - mean_x) * (points[x] - mean_y) for x in xs) / var
            slope = max(slope, 0.0)
            return round(base + mean_y + slope * (config.micro_batch - mean_x))
        slope = self._slope(config.checkpointing)
        if points:
            ((m, above),) = points.items()
            return round(base + above + slope * (config.micro_batch - m))
        return round(base + slope * config.micro_batch)
