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
and backward frees activations as it makes gradients. How much of ``G`` is off at the peak
depends on how the activations compare with the gradients, so it is learned. The prior, before
a trial without accumulation has run: half of ``G`` under ddp, zero1 and zero2 (which keep whole
gradients through backward), all of it under zero3 (FSDP keeps unsharded gradients between
micro-steps only while accumulating, in ``no_sync``, and reshards each block after its
backward); the profile's residual gets the prior share back when it ran without accumulation.
Each ok trial without accumulation then measures its share: its prediction as if it
accumulated (from its family's trials with accumulation, or the profile alone) less its
measured peak, over ``G``, within [0, 1]. A share holds for its *sharing class*, (zero3 or not,
checkpointing): under ddp, zero1 and zero2 the gradients appear block by block in backward as
the activations go, whatever the stage, while checkpointing keeps far fewer activations to
overlap them. The class predicts with the smallest share its trials measured (the safe side),
and a share above the prior only at micro-batches at least as large as the one it was measured
at (fewer activations overlap less of the gradients). Measured on three grids (``docs/level2.md``):
0.90-0.96 of ``G`` without checkpointing, 0.28-0.51 with it under ddp and zero1, so a fixed
share either skips configurations that fit or launches ones that do not. A trial that still
runs out of memory is pruned as any other.

Each measured trial then corrects its own (stage, checkpointing) family: one measurement fixes
the family's offset, two or more fit its line in the micro-batch, from its trials of the same
kind (with accumulation or without) where there are any. ``A`` is one micro-batch's figure, and
falls 3-12 % short of the slope that trials at several micro-batches measure, so a family not
yet fitted also predicts along every slope fitted by a family whose slope bounds its own (the
same checkpointing; ddp and zero1 bound every stage, zero2 and zero3 only each other), from
its one measured point or else the profile's micro-batch, and takes the largest prediction:
above the point that raises it, and a fitted slope never lowers it.

A trial without accumulation corrects the family's configurations with accumulation upwards
only, by what it measured over the prior's prediction: what it did not hold for lack of
accumulation says nothing of them.

Checkpointing's activation bytes come from the profile too: hooks on the repeated blocks
measure what each kept and the bytes of its input, so a checkpointed forward keeps ``A`` minus
what the blocks kept plus their inputs plus one block (recomputed in backward). Without
repeated blocks the uncheckpointed ``A`` bounds them from above.
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

    def unaccumulated_bytes(self, config: TrialConfig, share: float | None = None) -> float:
        """Gradient bytes that ``config`` does not hold at its peak for lack of accumulation
        (0 with accumulation): ``share`` of them, by default the prior
        :func:`unaccumulated_prior`."""
        if config.accumulation > 1:
            return 0.0
        return self.gradient_bytes * (unaccumulated_prior(config.stage) if share is None else share)

    def formula_bytes(
        self, config: TrialConfig, activation_bytes_per_sample: float, share: float | None = None
    ) -> float:
        """The model's peak of ``config`` without the residual, for a given activation slope
        (and share of the gradients off without accumulation; by default the prior)."""
        return (
            self.state_bytes(config.stage)
            + activation_bytes_per_sample * config.micro_batch
            - self.unaccumulated_bytes(config, share)
        )

    @property
    def residual_bytes(self) -> float:
        """What the formula misses at the profile configuration."""
        return self.profile_peak_bytes - self.formula_bytes(
            self.profile, self.activation_bytes_per_sample
        )


def unaccumulated_prior(stage: int) -> float:
    """The share of the gradients a configuration without accumulation is taken not to hold at
    its peak until a trial has measured it: half under ddp, zero1 and zero2, all under zero3."""
    return 1.0 if stage == 3 else 0.5


def sharing_class(config: TrialConfig) -> tuple[bool, bool]:
    """The configurations whose gradients overlap their activations alike without
    accumulation: (zero3, checkpointing). Under ddp, zero1 and zero2 whole gradients appear
    block by block in backward as the activations go, so how much of them coexists with the
    activations depends on the activations (checkpointing, micro-batch), not on the stage;
    zero3 reshards each block's gradients as it goes."""
    return (config.stage == 3, config.checkpointing)


@dataclass
class MemoryModel:
    """Predictions from :class:`ModelFacts`, corrected by every measured trial."""

    facts: ModelFacts
    _measured: dict[tuple[int, bool], dict[TrialConfig, int]] = field(default_factory=dict)
    #: Per sharing class, (share, micro-batch) learned from each trial without accumulation.
    _shares: dict[tuple[bool, bool], list[tuple[float, int]]] = field(default_factory=dict)

    def observe(self, config: TrialConfig, peak_bytes: int) -> None:
        """Record a trial's measured peak (a trial that finished its steps)."""
        if config.accumulation == 1 and self.facts.gradient_bytes > 0:
            self._learn_share(config, peak_bytes)
        family = self._measured.setdefault((config.stage, config.checkpointing), {})
        family[config] = max(peak_bytes, family.get(config, 0))

    def _learn_share(self, config: TrialConfig, peak_bytes: int) -> None:
        """The share of the gradients ``config`` (without accumulation) did not hold at its
        peak: its prediction as if it accumulated (from its family's trials with accumulation,
        or the profile alone) less its measured peak, over the gradient bytes, within [0, 1]."""
        accumulating = self._points(config, accumulating=True)
        as_if = self._from_points(config, accumulating, share=0.0)
        share = (as_if - peak_bytes) / self.facts.gradient_bytes
        self._shares.setdefault(sharing_class(config), []).append(
            (min(max(share, 0.0), 1.0), config.micro_batch)
        )

    def share(self, config: TrialConfig) -> float:
        """The share of the gradients ``config`` is predicted not to hold at its peak without
        accumulation: the smallest that its sharing class's trials measured (the prior before
        any), and a share above the prior only at micro-batches at least as large as the one it
        was measured at (fewer activations leave the gradients less to overlap)."""
        prior = unaccumulated_prior(config.stage)
        learned = self._shares.get(sharing_class(config), [])
        if not learned:
            return prior
        return min(
            share if config.micro_batch >= micro_batch else min(share, prior)
            for share, micro_batch in learned
        )

    def _base(self, config: TrialConfig, share: float | None = None) -> float:
        """Predicted bytes of ``config`` less its activations (with the learned share of the
        gradients off without accumulation, or ``share``)."""
        if share is None:
            share = self.share(config)
        return self.facts.formula_bytes(config, 0.0, share) + self.facts.residual_bytes

    def _single_slope(self, checkpointing: bool) -> float:
        """Bytes per sample of micro-batch from single points: the profile's, or for
        checkpointing the largest that a checkpointed trial measured over its base (at most
        the uncheckpointed one)."""
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

    def fitted_slopes(self, config: TrialConfig) -> list[float]:
        """The slopes in the micro-batch measured by the families whose slope bounds
        ``config``'s (:func:`carries_slope`): each family's least-squares line through its
        trials of one kind (with accumulation, or without) at two or more micro-batches."""
        slopes = []
        for (stage, checkpointing), family in self._measured.items():
            if not carries_slope(stage, checkpointing, config):
                continue
            member = next(iter(family))
            for accumulating in (True, False):
                points = self._points(member, accumulating)
                if len(points) >= 2:
                    slopes.append(line_through(points)[0])
        return slopes

    def _points(
        self, config: TrialConfig, accumulating: bool, share: float | None = None
    ) -> dict[int, float]:
        """The measurements of ``config``'s family with (or without) accumulation, each less
        the base at its micro-batch (with ``share`` if given): the family's activations and
        offset."""
        family = self._measured.get((config.stage, config.checkpointing), {})
        return {
            c.micro_batch: peak - self._base(c, share)
            for c, peak in family.items()
            if (c.accumulation > 1) == accumulating
        }

    def predict(self, config: TrialConfig) -> int:
        """Predicted peak bytes per rank of ``config``: from its family's trials of its own
        kind (with or without accumulation), else of the other kind. A trial without
        accumulation corrects one with accumulation upwards only, by what it measured over the
        prior's prediction: what it did not hold for lack of accumulation says nothing of a
        configuration that accumulates."""
        accumulating = config.accumulation > 1
        points = self._points(config, accumulating)
        if points:
            return round(self._from_points(config, points))
        if not accumulating:
            return round(self._from_points(config, self._points(config, True)))
        # Measured above the prior's line (whatever the share), the family holds more.
        prior = unaccumulated_prior(config.stage)
        above_prior = self._from_points(config, self._points(config, False, prior))
        return round(max(above_prior, self._from_points(config, {})))

    def _from_points(
        self, config: TrialConfig, points: dict[int, float], share: float | None = None
    ) -> float:
        """``config``'s base plus its activations: the line through ``points`` (two or more);
        else from one point's offset (or the profile's micro-batch) along the single-point
        slope, or along a slope that agreeing families measured where that predicts more (a
        single point's figure falls short of the slope: never below it)."""
        base = self._base(config, share)
        if len(points) >= 2:
            slope, mean_x, mean_y = line_through(points)
            return base + mean_y + slope * (config.micro_batch - mean_x)
        single = self._single_slope(config.checkpointing)
        if points:
            ((anchor, above),) = points.items()
        else:
            anchor = self.facts.profile.micro_batch
            above = single * anchor
        return base + max(
            above + slope * (config.micro_batch - anchor)
            for slope in [single, *self.fitted_slopes(config)]
        )


def carries_slope(stage: int, checkpointing: bool, config: TrialConfig) -> bool:
    """Whether the slope that family (``stage``, ``checkpointing``) measured bounds
    ``config``'s from below: the same checkpointing, and a family on whole parameters (ddp,
    zero1) for every stage, an FSDP one (zero2, zero3) for FSDP only. ddp and zero1 run the
    same forward and backward (their slopes agree to 0.1 % on every grid measured); FSDP's peak
    grows at that slope too once the activations dominate it (one context-256 grid), and up to
    30 % more slowly before (context 32: its peak falls elsewhere in the step)."""
    if checkpointing != config.checkpointing:
        return False
    return stage < 2 or config.stage >= 2


def line_through(points: dict[int, float]) -> tuple[float, float, float]:
    """The least-squares line through ``points`` (micro-batch: bytes), two or more: its slope
    (never below 0), and the mean micro-batch and bytes it passes through."""
    xs = sorted(points)
    n = len(xs)
    mean_x = sum(xs) / n
    mean_y = sum(points[x] for x in xs) / n
    var = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (points[x] - mean_y) for x in xs) / var
    return max(slope, 0.0), mean_x, mean_y
