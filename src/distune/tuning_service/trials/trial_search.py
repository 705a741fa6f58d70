"""The level-2 policy: which trial to run next, and which configuration wins.

Families are (ZeRO stage, checkpointing, bf16), cheapest first: checkpointing off before on,
then DDP, ZeRO-1, -2, -3, each in full precision and then (only where the config allows mixed
precision) in bf16, which is searched as a family of its own: it changes speed more than memory,
so it is compared with the cheaper families of its own precision only, and predicted as its
full-precision twin until a trial of its own has measured it. The rules:

* **Largest first.** In each family the search starts at the largest micro-batch the memory
  model predicts to fit (never one predicted not to), because a larger micro-batch means fewer
  accumulation steps and better-used kernels. An out-of-memory trial prunes its micro-batch and
  every larger one of the family (and of the same stage without checkpointing, which needs more
  memory still) and the search steps down. A family the memory model, corrected by later
  trials, predicts to fit a larger micro-batch than it ran goes on there.
* **Step down from near full.** A configuration that ran near the memory cap may be slowed by
  it (allocator pressure, smaller kernels elsewhere), so from there the search steps down, and
  on while the smaller micro-batch is faster by more than the two trials' own spread; so does
  a search for the lowest latency, whose step time may fall with the micro-batch when the
  global batch is free to change.
* **A step down already answered is not run.** Where a cheaper family already ran the smaller
  micro-batch: at one micro-batch more sharding or recomputation only adds work, so that
  measured trial bounds the step down, which could then beat neither it nor, where it was
  slower, the near-full trial. And where
  a trial at least as full (as a share of the cap) was already seen unhurt by the cap, its
  family's next smaller micro-batch having run not clearly faster: the cap's pressure grows
  with the share of it in use, so that answers every trial no fuller.
* **Sharding and checkpointing only where they make room.** They are tried only where they are
  predicted to fit a larger micro-batch than the cheaper ways already reached (a lower stage,
  or the same stage without checkpointing): recomputation and sharding's extra communication
  cost time, and pay only by making room (DeepSpeed's autotuner stops climbing stages for the
  same reason). So is a family whose larger micro-batches ran out of memory: what it still fits
  must be larger than what the cheaper ways reached. The exception is the micro-batch where
  every cheaper family that ran it ran near the cap: there the room a more sharded family frees
  may be what makes it faster, so the next such family gets one trial at that micro-batch (once
  per micro-batch and precision), and goes on only if it was faster; unless the near-full
  trial's own step down ran with room and was not clearly faster, which shows the cap did not
  slow it (a step down near the cap too shows nothing: the cap may have slowed both).
* A family whose trial crashed, hung or was invalid is given up; a crash because the model's
  parameters went NaN or inf (``diverged``) prunes its micro-batch and larger ones in every
  family of its precision instead, as an out of memory prunes its own family's.
* **Nothing is run that cannot beat the best measured.** Before a search trial runs, its
  throughput is bounded from above by what was measured, on two premises the rules above
  already use: at one micro-batch sharding or recomputation only adds work, and a larger
  micro-batch saves compute with diminishing returns (each doubling saves no more step time
  than the doubling before it: fixed costs per micro-batch are spread ever thinner). So a
  measured trial of the family, or of one that needs no more sharding and no more recomputation,
  bounds it at its own micro-batch, and at a larger one by its step time less the saving per
  doubling that two measured micro-batches below showed, once per doubling (ddp and zero1,
  which communicate once a step, share their savings; FSDP's stages save by their own). A
  trial near the cap bounds nothing: the cap may have slowed it. Where the best configuration
  measured so far (often the script's own start, where the job is already near its best) beats
  a trial's bound by more than the spread of the trials behind either, it is not run.
* **The choice, drift-proof.** Finally the two best configurations by their first measurements
  are measured once more, back to back (only those two: a drift of the machine's load between
  trials would otherwise chase every configuration measured once), and the two are compared
  within pairs: each first measurement against the other's, each re-measure against the
  other's (the larger geometric mean of its two values wins). A ratio within a round cancels
  what the load did between rounds, and the back-to-back pair ran under one load; a
  configuration measured once cannot win on a value the load may have lifted (see
  :func:`chosen`). Where a re-measure did not run ok, the best mean wins.
* **No re-measure that cannot change the choice.** The best is measured again first; its two
  runs are then what the search knows of the noise between two runs of one configuration (on
  the shared machine of BENCHMARKS.md 2-4 times one trial's own spread, and it is the noise
  that matters to a choice between two trials). Where its mean leads the next configuration's
  one run by more than that noise allows a tie (:data:`LEAD_OVER_NOISE` times the pair's range,
  or the trials' own spread where larger: one pair is a poor estimate, so the test is Student's
  with one degree of freedom), the next is not measured again and the best's mean chooses.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from distune.tuning_service.trials.memory_model import MemoryModel
from distune.tuning_service.trials.trial_config import STRATEGY_NAMES, TrialConfig
from distune.tuning_service.trials.trial_result import (
    CRASH,
    LATENCY,
    OK,
    OOM,
    THROUGHPUT,
    TrialResult,
)
from distune.tuning_service.trials.trial_space import TrialSpace

#: A trial whose measured peak is at least this share of the cap ran "near full".
NEAR_FULL = 0.85
#: How many of the best configurations are measured again before choosing.
REMEASURED = 2
#: The purpose of a trial that measures a configuration again before choosing.
REMEASURE = "remeasure"
#: How many times the noise the best configuration, measured twice, must lead the next one,
#: measured once, by for the next not to be measured again: one pair of runs is all a run
#: knows of its noise, so the lead is tested one-sided at 90 % against Student's t with one
#: degree of freedom (3.078), on the difference of a mean of two runs and one run (its
#: deviation sqrt(3/2) of one run's, whose deviation the pair's range over sqrt(2) estimates).
LEAD_OVER_NOISE = 3.078 * math.sqrt(3 / 4)
#: A family of configurations: (ZeRO stage, activation checkpointing, bf16).
Family = tuple[int, bool, bool]
#: Stages that communicate once an optimizer step whatever the accumulation (distune's DDP
#: reduces in the last micro-step only; ZeRO-1 adds the parameters' broadcast after the step),
#: so a larger micro-batch saves them the same compute; FSDP (ZeRO-2, -3) may communicate in
#: every micro-step, so its saving is its own.
PER_STEP_COMMUNICATION = (0, 1)


def ranking(results: Iterable[TrialResult], metric: str) -> list[tuple[TrialConfig, float]]:
    """The configurations of the ok ``results``, best first, each with the mean of its values
    of ``metric`` (as numbers to maximise: latency negated)."""
    values: dict[TrialConfig, list[float]] = {}
    for result in results:
        if result.outcome == OK:
            values.setdefault(result.config, []).append(result.value(metric))
    means = [(config, sum(v) / len(v)) for config, v in values.items()]
    return sorted(means, key=lambda item: (-item[1], item[0]))


def remeasured_pair(results: Iterable[TrialResult], metric: str) -> list[TrialConfig]:
    """The configurations the search re-measures: the best :data:`REMEASURED` by their first
    measurements (re-measures left out, so the pair never changes as they come in)."""
    first = [r for r in results if r.purpose != REMEASURE]
    return [config for config, _ in ranking(first, metric)[:REMEASURED]]


def twice_measured(results: Iterable[TrialResult]) -> set[TrialConfig]:
    """The configurations with two ok measurements or more."""
    counts: dict[TrialConfig, int] = {}
    for result in results:
        if result.outcome == OK:
            counts[result.config] = counts.get(result.config, 0) + 1
    return {config for config, count in counts.items() if count > 1}


def settled_pair(results: Iterable[TrialResult], metric: str) -> list[TrialConfig]:
    """The re-measured pair once both re-measures ran ok, else ``[]``: only then can the two
    be compared within pairs."""
    results = list(results)
    pair = remeasured_pair(results, metric)
    again = {r.config for r in results if r.purpose == REMEASURE and r.outcome == OK}
    return pair if len(pair) > 1 and all(config in again for config in pair) else []


def chosen(results: Iterable[TrialResult], metric: str) -> TrialConfig | None:
    """The winning configuration of ``results``: of the re-measured pair, where both
    re-measures ran ok, the one ahead when compared within pairs (its first measurement over
    the other's, times its re-measure over the other's); else the best mean (None: no ok
    trial).

    A machine's load drifts between trials (on the shared CPU of BENCHMARKS.md, whole trials
    18-37 % apart from one grid pass to the next, while the steps of one trial agree within
    8 %), so a value says as much about the load when it ran as about the configuration. A
    ratio of two trials of one round cancels what drifted between rounds, and the re-measures
    run back to back, under one load. A configuration measured once, below both of the pair,
    cannot win on a value the load may have lifted: the first measurements only chose the
    pair."""
    results = list(results)
    ranked = ranking(results, metric)
    if not ranked:
        return None
    pair = settled_pair(results, metric)
    if pair:
        # The within-pair ratios multiply to a ratio of the two's products of values, so the
        # larger geometric mean wins (latency's values are negated: the smaller one's).
        def level(config: TrialConfig) -> float:
            values = [r.value(metric) for r in results if r.config == config and r.outcome == OK]
            log_mean = statistics.fmean(math.log(abs(v)) for v in values)
            return log_mean if values[0] > 0 else -log_mean

        return max(pair, key=level)
    return ranked[0][0]


@dataclass(frozen=True)
class Bound:
    """The most throughput an unmeasured configuration can reach by what was measured: the
    trial it comes from, and the largest spread of the trials behind it."""

    value: float
    anchor: TrialResult
    noise: float


@dataclass(frozen=True)
class Proposal:
    """The next trial to run, with why and what memory it is predicted to take."""

    config: TrialConfig
    purpose: str
    predicted_memory_bytes: int | None


@dataclass
class TrialSearch:
    """Proposes trials from ``space`` one at a time; told each result with :meth:`record`."""

    space: TrialSpace
    memory: MemoryModel | None
    memory_cap: int | None
    max_trials: int
    metric: str = THROUGHPUT
    results: list[TrialResult] = field(default_factory=list)
    decisions: list[str] = field(default_factory=list)
    _oom_at: dict[Family, int] = field(default_factory=dict)
    _given_up: set[Family] = field(default_factory=set)
    _remeasuring: bool = False
    #: Families on their one trial where cheaper ones ran near full: the trial it must beat.
    _relieving: dict[Family, TrialResult] = field(default_factory=dict)
    #: (micro-batch, bf16) where a relief trial ran: the cap's effect there is tested once.
    _relief_tested: set[tuple[int, bool]] = field(default_factory=set)
    #: bf16 trials' own memory model (same facts), and the families it has measured.
    _bf16_memory: MemoryModel | None = None
    _bf16_measured: set[tuple[int, bool]] = field(default_factory=set)

    def __post_init__(self) -> None:
        if self.memory is not None:
            self._bf16_memory = MemoryModel(self.memory.facts)

    def families(self) -> list[Family]:
        """(stage, checkpointing, bf16) in the order they are searched."""
        return [
            (s, c, b)
            for c in self.space.checkpointing()
            for s in self.space.stages()
            for b in self.space.precisions()
        ]

    def predicted(self, config: TrialConfig) -> int | None:
        """Predicted peak bytes per rank (None without a memory model)."""
        if self.memory is None or self._bf16_memory is None:
            return None
        if not config.bf16:
            return self.memory.predict(config)
        if (config.stage, config.checkpointing) in self._bf16_measured:
            return self._bf16_memory.predict(config)
        return self.memory.predict(replace(config, bf16=False))

    def fits(self, config: TrialConfig) -> bool:
        """Whether ``config`` is predicted to fit under the cap (always, without a cap)."""
        predicted = self.predicted(config)
        return self.memory_cap is None or predicted is None or predicted <= self.memory_cap

    def record(self, result: TrialResult) -> None:
        """Take a finished trial's result into account."""
        self.results.append(result)
        config = result.config
        family = (config.stage, config.checkpointing, config.bf16)
        if result.outcome == OK:
            self._observe(config, result.peak_memory_bytes)
        elif result.outcome == CRASH and result.diverged:
            # Its loss diverged at this micro-batch (or precision), whatever the strategy: the
            # same micro-batch and larger would in every family of its precision, and smaller
            # ones may train; so they are pruned as an out of memory prunes its family's.
            for key in self.families():
                if key[2] == config.bf16:
                    self._oom_at[key] = min(
                        self._oom_at.get(key, config.micro_batch), config.micro_batch
                    )
            self.decisions.append(
                f"{config.describe()}: its parameters went NaN or inf; micro-batches >= "
                f"{config.micro_batch} pruned in every strategy of its precision"
            )
        elif result.outcome == OOM:
            pruned = [family] + (
                [(config.stage, False, config.bf16)] if config.checkpointing else []
            )
            for key in pruned:
                self._oom_at[key] = min(
                    self._oom_at.get(key, config.micro_batch), config.micro_batch
                )
            self.decisions.append(
                f"{config.describe()}: out of memory; micro-batches >= {config.micro_batch} "
                f"of {config.strategy} pruned"
            )
        else:
            self._given_up.add(family)
            self.decisions.append(f"{config.strategy}: given up after a {result.outcome} trial")
        if result.purpose == REMEASURE:
            self._say_choice()

    def _say_choice(self) -> None:
        """Once the pair's re-measures are in, say which won them."""
        pair = settled_pair(self.results, self.metric)
        if not pair:
            return
        winner = self.best()
        values = "; ".join(
            f"{c.describe()}: " + ", ".join(f"{abs(v):.4g}" for v in self.scores(c)) for c in pair
        )
        self.decisions.append(
            f"{winner.describe() if winner else '-'}: chosen within pairs, first measurements "
            f"and back-to-back re-measures ({values})"
        )

    def _observe(self, config: TrialConfig, peak: int | None) -> None:
        if self.memory is None or self._bf16_memory is None or peak is None:
            return
        if config.bf16:
            self._bf16_memory.observe(config, peak)
            self._bf16_measured.add((config.stage, config.checkpointing))
        else:
            self.memory.observe(config, peak)

    def scores(self, config: TrialConfig) -> list[float]:
        """Every ok measurement of ``config``, as values to maximise."""
        return [
            r.value(self.metric) for r in self.results if r.config == config and r.outcome == OK
        ]

    def ranking(self) -> list[tuple[TrialConfig, float]]:
        """Measured configurations, best first, by the mean of their measurements."""
        return ranking(self.results, self.metric)

    def best(self) -> TrialConfig | None:
        """The winning configuration so far (see :func:`chosen`), or None if no trial
        succeeded."""
        return chosen(self.results, self.metric)

    def next_trial(self) -> Proposal | None:
        """The next trial to run, or None when the search is over."""
        if len(self.results) >= self.max_trials:
            return None
        if not self._remeasuring:
            # The last trials of the budget go to re-measuring the best two, once two ran ok:
            # re-measuring the only configuration measured cannot change the choice.
            reserve = REMEASURED if len(self.ranking()) >= REMEASURED else 0
            if len(self.results) < self.max_trials - reserve:
                for family in self.families():
                    proposal = self._next_in_family(*family)
                    if proposal is not None and self._may_win(family, proposal.config):
                        return proposal
            self._remeasuring = True
        # Each of the best two by first measurements once more, the best first, and no more: a
        # configuration whose first measurement ranks it first after the others' second ones
        # fell (a machine's load drifts between trials) is not chased further. The next is not
        # measured again where the best, measured twice, leads it by more than the noise.
        again = {r.config for r in self.results if r.purpose == REMEASURE}
        pair = remeasured_pair(self.results, self.metric)
        if len(pair) < REMEASURED:
            if pair:
                self._decide(
                    f"{pair[0].describe()}: the only configuration that ran ok; not measured "
                    "again (a re-measure could choose nothing else)"
                )
            return None
        for config in pair:
            if config in again:
                continue
            if self._clear_lead():
                return None
            return Proposal(config, REMEASURE, self.predicted(config))
        return None

    def _clear_lead(self) -> bool:
        """Whether the best of the re-measured pair, measured twice, beats the other, measured
        once, by more than the noise (:meth:`noise`, with the noise between two runs that its
        two runs showed): a re-measure of the other would have to lift it further than two
        runs of one configuration moved apart, so it is not run and the best's mean chooses."""
        pair = remeasured_pair(self.results, self.metric)
        if len(pair) < 2:
            return False
        leader, runner = pair
        twice = twice_measured(self.results)
        if leader not in twice or runner in twice:
            return False
        value = statistics.fmean(self.scores(leader))
        other = statistics.fmean(self.scores(runner))
        noise = self.noise(r for r in self.results if r.config in pair and r.outcome == OK)
        if value - other <= LEAD_OVER_NOISE * noise * abs(other):
            return False
        values = ", ".join(f"{abs(v):.4g}" for v in self.scores(leader))
        decision = (
            f"{leader.describe()}: chosen, measured twice ({values}) and ahead of "
            f"{runner.describe()} ({abs(other):.4g}) by more than {LEAD_OVER_NOISE:.3g} x the "
            f"noise ({noise:.1%}: the distance between two runs of one configuration, or the "
            "trials' own spread where larger); not measured again"
        )
        self._decide(decision)
        return True

    def _decide(self, decision: str) -> None:
        """Record ``decision`` once: a rule asked again about the same trials answers alike."""
        if decision not in self.decisions:
            self.decisions.append(decision)

    def clearly_better(self, result: TrialResult, other: TrialResult) -> bool:
        """Whether ``result`` beats ``other`` by more than the noise (:meth:`noise`) of the
        two."""
        value, base = result.value(self.metric), other.value(self.metric)
        return value - base > self.noise([result, other]) * abs(base)

    def noise(self, results: Iterable[TrialResult]) -> float:
        """How far apart two measurements must be to say which is faster, as a share: the
        largest of the noise between two runs (:meth:`run_noise`, 0 until known) and the
        spreads of ``results``' own steps (a trial without one counts as 0)."""
        spreads = [r.throughput_spread or 0.0 for r in results]
        return max([self.run_noise() or 0.0, *spreads])

    def run_noise(self) -> float | None:
        """How far two runs of one configuration land apart, as a share of their mean: the
        largest relative range of the measurements of a configuration measured ok twice or
        more (None: none was)."""
        ranges = []
        for config in twice_measured(self.results):
            values = self.scores(config)
            ranges.append((max(values) - min(values)) / abs(statistics.fmean(values)))
        return max(ranges, default=None)

    def _may_win(self, family: Family, config: TrialConfig) -> bool:
        """Whether ``config`` may beat the best configuration measured so far: unless that
        best beats ``config``'s bound (:meth:`bound`) by more than the noise (the largest
        spread of the trials behind either), the trial runs. A family proposing it again is
        passed over again; a larger micro-batch it comes to fit is bounded anew."""
        bound = self.bound(config)
        ranked = self.ranking()
        if bound is None or math.isinf(bound.value) or not ranked:
            return True
        best, value = ranked[0]
        noise = max(bound.noise, self.noise(r for r in self.results if r.config == best))
        if value - bound.value <= noise * bound.value:
            return True
        if self._relieving.pop(family, None) is not None:
            self._given_up.add(family)
        decision = (
            f"{config.describe()}: not run, it can reach {bound.value:.4g} at most (from "
            f"{bound.anchor.config.describe()}), and {best.describe()} measured {value:.4g}"
        )
        self._decide(decision)
        return False

    def bound(self, config: TrialConfig) -> Bound | None:
        """The most throughput ``config`` can reach by what was measured (None: nothing
        bounds it, or the metric or the global batch is not fixed).

        Any measured trial of ``config``'s family or of one that needs no more sharding and no
        more recomputation (at one micro-batch they only add work), at ``config``'s micro-batch
        or below, bounds it: its step time, less what the larger micro-batch can save, which
        diminishing returns bound by the saving per doubling that two measured micro-batches
        of one compute class showed at or below the anchor's (:meth:`_saving_per_doubling`),
        once for each doubling from the anchor's micro-batch up. A trial near the cap bounds
        nothing (:meth:`_anchors`)."""
        if self.metric != THROUGHPUT or self.space.allow_batch_change:
            return None
        family = (config.stage, config.checkpointing, config.bf16)
        bounds = []
        for key in [family, *self._cheaper(family)]:
            for micro, anchor in self._tried(key).items():
                if micro > config.micro_batch or not self._anchors(anchor):
                    continue
                assert anchor.step_seconds is not None and anchor.throughput is not None
                doublings = math.log2(config.micro_batch / micro)
                saving = self._saving_per_doubling(key, micro) if doublings else (0.0, [])
                if saving is None:
                    continue
                fastest = anchor.step_seconds - saving[0] * doublings
                reach = (
                    anchor.throughput * anchor.step_seconds / fastest if fastest > 0 else math.inf
                )
                behind = [anchor, *saving[1]]
                noise = max(r.throughput_spread or 0.0 for r in behind)
                bounds.append(Bound(reach, anchor, noise))
        return min(bounds, key=lambda b: b.value, default=None)

    def _anchors(self, result: TrialResult) -> bool:
        """Whether ``result`` may bound other configurations: ok, measured in the search
        (a re-measure's value is not compared on its own), and not near the cap, which may
        have slowed it."""
        if result.outcome != OK or result.step_seconds is None or result.purpose == REMEASURE:
            return False
        return not self._near_full(result)

    def _saving_per_doubling(
        self, family: Family, micro_batch: int
    ) -> tuple[float, list[TrialResult]] | None:
        """The most step time a doubling of the micro-batch saved, between two trials of
        ``family``'s compute class (its own family, or for stages that communicate once a step
        any such stage of the same checkpointing and precision) at or below ``micro_batch``,
        both anchors, with the two (None: no two). Diminishing returns make it a bound on
        every doubling above (never below 0: a larger micro-batch that was slower saves
        nothing)."""
        stage, checkpointing, bf16 = family
        stages = PER_STEP_COMMUNICATION if stage in PER_STEP_COMMUNICATION else (stage,)
        savings = []
        for key in [(s, checkpointing, bf16) for s in stages if s in self.space.stages()]:
            tried = self._tried(key)
            below = sorted(m for m, r in tried.items() if m <= micro_batch and self._anchors(r))
            for small, large in itertools.pairwise(below):
                slow, fast = tried[small], tried[large]
                assert slow.step_seconds is not None and fast.step_seconds is not None
                per_doubling = (slow.step_seconds - fast.step_seconds) / math.log2(large / small)
                savings.append((max(per_doubling, 0.0), [slow, fast]))
        return max(savings, key=lambda s: s[0], default=None)

    def _tried(self, family: Family) -> dict[int, TrialResult]:
        return {
            r.config.micro_batch: r
            for r in self.results
            if (r.config.stage, r.config.checkpointing, r.config.bf16) == family
        }

    def _next_in_family(self, stage: int, checkpointing: bool, bf16: bool) -> Proposal | None:
        family = (stage, checkpointing, bf16)
        if family in self._given_up:
            return None
        tried = self._tried(family)
        oom_at = self._oom_at.get(family)
        fitting = [
            m
            for m in self.space.micro_batches()
            if (oom_at is None or m < oom_at)
            and self.fits(self.space.config(stage, checkpointing, m, bf16))
        ]
        if family in self._relieving and not self._relieved(family, tried):
            return None
        ok = [m for m, r in tried.items() if r.outcome == OK]
        reached = self._reached_by_cheaper(family)
        # Also once its larger micro-batches ran out of memory: what still fits must make room.
        if fitting and not ok and max(fitting) <= reached:
            pressed = self._pressed_at(family, reached) if max(fitting) == reached else None
            if pressed is None:
                self._skip(family, max(fitting), reached)
                return None
            return self._relieve(family, pressed)
        above = [m for m in fitting if m > max(ok, default=0) and m not in tried]
        if above:
            return self._propose(family, max(above))
        if not ok:
            return None
        return self._step_down(family, fitting, tried, max(ok))

    def _cheaper(self, family: Family) -> list[Family]:
        """The families of the same precision that need no more sharding and no more
        recomputation than ``family``."""
        stage, checkpointing, bf16 = family
        return [
            (s, c, bf16)
            for s in self.space.stages()
            for c in self.space.checkpointing()
            if s <= stage and c <= checkpointing and (s, c, bf16) != family
        ]

    def _reached_by_cheaper(self, family: Family) -> int:
        """The largest micro-batch that ran ok in a cheaper family of the same precision (0:
        none). Checkpointing costs recomputation and sharding costs communication: each pays
        only where it fits a larger micro-batch than the cheaper ways already reached."""
        return max(
            (
                m
                for key in self._cheaper(family)
                for m, r in self._tried(key).items()
                if r.outcome == OK
            ),
            default=0,
        )

    def _pressed_at(self, family: Family, micro_batch: int) -> TrialResult | None:
        """The fastest cheaper trial at ``micro_batch`` if every cheaper family that ran it ran
        near the cap (None otherwise): there the cap may have slowed them, which the memory
        ``family`` frees could undo, as stepping down the micro-batch could. Not where that
        trial's step down already answered it: it ran with room (not near the cap) and was not
        clearly faster, so the cap did not slow the fuller one by more than a larger
        micro-batch saves. A step down near the cap too answers nothing: the cap may have slowed
        both."""
        at = [
            r
            for key in self._cheaper(family)
            for m, r in self._tried(key).items()
            if m == micro_batch and r.outcome == OK
        ]
        tested = (micro_batch, family[2]) in self._relief_tested
        if tested or not at or not all(self._near_full(r) for r in at):
            return None
        pressed = max(at, key=lambda r: r.value(self.metric))
        below = self._next_smaller(pressed)
        if below is None or self._near_full(below) or self.clearly_better(below, pressed):
            return pressed
        decision = (
            f"{self._name(family)}: no trial at micro-batch {micro_batch}, "
            f"{pressed.config.describe()} ran near the cap but {below.config.describe()}, "
            "with room, was not faster"
        )
        self._decide(decision)
        return None

    def _next_smaller(self, result: TrialResult) -> TrialResult | None:
        """The ok trial of ``result``'s family at the next smaller micro-batch it ran (None:
        none)."""
        config = result.config
        tried = self._tried((config.stage, config.checkpointing, config.bf16))
        below = [m for m, r in tried.items() if m < config.micro_batch and r.outcome == OK]
        return tried[max(below)] if below else None

    def _relieve(self, family: Family, pressed: TrialResult) -> Proposal:
        """One trial of ``family`` at the micro-batch where the cheaper ones ran near full."""
        micro_batch = pressed.config.micro_batch
        self._relieving[family] = pressed
        self._relief_tested.add((micro_batch, family[2]))
        self.decisions.append(
            f"{self._name(family)}: one trial at micro-batch {micro_batch}, where the cheaper "
            f"{pressed.config.strategy} ran near the cap; kept only if faster"
        )
        return self._propose(family, micro_batch)

    def _relieved(self, family: Family, tried: dict[int, TrialResult]) -> bool:
        """Whether ``family``'s trial at the pressed micro-batch beat the cheaper one there (the
        family then goes on as any other); if not, it is given up."""
        pressed = self._relieving.pop(family)
        result = tried.get(pressed.config.micro_batch)
        beaten = pressed.value(self.metric)
        if result is not None and result.outcome == OK and result.value(self.metric) > beaten:
            return True
        self._given_up.add(family)
        self.decisions.append(
            f"{self._name(family)}: given up, not faster than {pressed.config.describe()}"
        )
        return False

    def _step_down(
        self,
        family: Family,
        fitting: list[int],
        tried: dict[int, TrialResult],
        largest_ok: int,
    ) -> Proposal | None:
        """Step down from the largest ok micro-batch: only from a near-full one (or for
        latency), and on only while each step down was faster than the one above it by more
        than the two trials' spread (a step down that is faster within the noise says nothing)."""
        chain = [largest_ok]
        while True:
            current = tried[chain[-1]]
            if len(chain) == 1:
                if not self._near_full(current) and self.metric != LATENCY:
                    return None
            elif not self.clearly_better(current, tried[chain[-2]]):
                return None
            lower = [m for m in fitting if m < chain[-1]]
            if not lower:
                return None
            below = max(lower)
            if below not in tried:
                if self._answered_below(family, current, below):
                    return None
                if len(chain) == 1 and self.metric != LATENCY and self._unhurt_at(current):
                    return None
                return self._propose(family, below)
            if tried[below].outcome != OK:
                return None
            chain.append(below)

    def _unhurt_at(self, current: TrialResult) -> bool:
        """Whether a trial at least as full as ``current`` was already seen unhurt by the cap:
        the next smaller micro-batch of its family ran and was not clearly faster. A step down
        asks whether the cap's pressure slows a near-full trial; the pressure grows with the
        share of the cap in use, so where a fuller trial was not slowed, ``current`` is not
        stepped down either."""
        fullness = self._fullness(current)
        for result in self.results:
            config = result.config
            if result.outcome != OK or result is current or self._fullness(result) < fullness:
                continue
            below = self._next_smaller(result)
            if below is not None and not self.clearly_better(below, result):
                decision = (
                    f"{current.config.describe()}: not stepped down, "
                    f"{below.config.describe()} was not faster than the fuller "
                    f"{config.describe()}"
                )
                self._decide(decision)
                return True
        return False

    def _fullness(self, result: TrialResult) -> float:
        """The share of the cap ``result``'s measured peak took (0 without either)."""
        if self.memory_cap is None or result.peak_memory_bytes is None:
            return 0.0
        return result.peak_memory_bytes / self.memory_cap

    def _name(self, family: Family) -> str:
        stage, checkpointing, bf16 = family
        name = STRATEGY_NAMES[stage] + (" with checkpointing" if checkpointing else "")
        return name + (" in bf16" if bf16 else "")

    def _answered_below(self, family: Family, current: TrialResult, below: int) -> bool:
        """Whether a cheaper family already ran micro-batch ``below``. A step down asks whether
        the smaller micro-batch, with room to spare, beats the near-full ``current``; at one
        micro-batch more sharding or recomputation adds work (the premise of skipping
        strategies), so this family's ``below`` is predicted no faster than the cheaper one's:
        slower than ``current`` it loses, faster it still cannot beat that measured trial. It
        is not run."""
        for key in self._cheaper(family):
            cheaper = self._tried(key).get(below)
            if cheaper is None or cheaper.outcome != OK:
                continue
            slower = cheaper.value(self.metric) <= current.value(self.metric)
            decision = (
                f"{current.config.describe()}: not stepped down, {cheaper.config.describe()} "
                + ("was slower" if slower else "bounds it and was measured")
            )
            self._decide(decision)
            return True
        return False

    def _skip(self, family: Family, fits: int, reached: int) -> None:
        if family not in self._given_up:
            self._given_up.add(family)
            self.decisions.append(
                f"{self._name(family)}: skipped, it fits micro-batch {fits} at most and a "
                f"cheaper strategy reached {reached}"
            )

    def _near_full(self, result: TrialResult) -> bool:
        peak = result.peak_memory_bytes
        return (
            self.memory_cap is not None and peak is not None and peak >= NEAR_FULL * self.memory_cap
        )

    def _propose(self, family: Family, micro_batch: int) -> Proposal:
        stage, checkpointing, bf16 = family
        config = self.space.config(stage, checkpointing, micro_batch, bf16)
        return Proposal(config, "search", self.predicted(config))
