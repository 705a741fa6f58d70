"""The level-2 policy: which trial to run next, and which configuration wins.

Families are (ZeRO stage, checkpointing), cheapest first: checkpointing off before on, then
DDP, ZeRO-1, -2, -3. In each family the search starts at the largest micro-batch the memory
model predicts to fit (never one predicted not to), because a larger micro-batch means fewer
accumulation steps and better-used kernels. An out-of-memory trial prunes its micro-batch and
every larger one of the family (and of the same stage without checkpointing, which needs more
memory still) and the search steps down. A configuration that ran near the memory cap may be
slowed by it (allocator pressure, smaller kernels elsewhere), so from there the search steps
down while the smaller micro-batch is faster; so does a search for the lowest latency, whose
step time may fall with the micro-batch when the global batch is free to change.
Checkpointing and sharding are tried only where they are predicted to fit a larger
micro-batch than the cheaper ways already reached (a lower stage, or the same stage without
checkpointing): recomputation and sharding's extra communication cost time, and pay only by
making room (DeepSpeed's autotuner stops climbing stages for the same reason).
A family whose trial crashed, hung or was invalid is given up. Finally the two best
configurations are measured once more, and the best mean wins.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from distune.tuning_service.trials.memory_model import MemoryModel
from distune.tuning_service.trials.trial_config import TrialConfig
from distune.tuning_service.trials.trial_result import LATENCY, OK, OOM, THROUGHPUT, TrialResult
from distune.tuning_service.trials.trial_space import TrialSpace

#: A trial whose measured peak is at least this share of the cap ran "near full".
NEAR_FULL = 0.85
#: How many of the best configurations are measured again before choosing.
REMEASURED = 2


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
    _oom_at: dict[tuple[int, bool], int] = field(default_factory=dict)
    _given_up: set[tuple[int, bool]] = field(default_factory=set)
    _remeasuring: bool = False

    def families(self) -> list[tuple[int, bool]]:
        """(stage, checkpointing) in the order they are searched."""
        return [(s, c) for c in self.space.checkpointing() for s in self.space.stages()]

    def predicted(self, config: TrialConfig) -> int | None:
        """Predicted peak bytes per rank (None without a memory model)."""
        return None if self.memory is None else self.memory.predict(config)

    def fits(self, config: TrialConfig) -> bool:
        """Whether ``config`` is predicted to fit under the cap (always, without a cap)."""
        predicted = self.predicted(config)
        return self.memory_cap is None or predicted is None or predicted <= self.memory_cap

    def record(self, result: TrialResult) -> None:
        """Take a finished trial's result into account."""
        self.results.append(result)
        config = result.config
        family = (config.stage, config.checkpointing)
        if result.outcome == OK:
            if self.memory is not None and result.peak_memory_bytes is not None:
                self.memory.observe(config, result.peak_memory_bytes)
        elif result.outcome == OOM:
            pruned = [family] + ([(config.stage, False)] if config.checkpointing else [])
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

    def scores(self, config: TrialConfig) -> list[float]:
        """Every ok measurement of ``config``, as values to maximise."""
        return [
            r.value(self.metric) for r in self.results if r.config == config and r.outcome == OK
        ]

    def ranking(self) -> list[tuple[TrialConfig, float]]:
        """Measured configurations, best first, by the mean of their measurements."""
        configs = {r.config for r in self.results if r.outcome == OK}
        means = [(c, sum(self.scores(c)) / len(self.scores(c))) for c in configs]
        return sorted(means, key=lambda item: (-item[1], item[0]))

    def best(self) -> TrialConfig | None:
        """The winning configuration so far, or None if no trial succeeded."""
        ranking = self.ranking()
        return ranking[0][0] if ranking else None

    def next_trial(self) -> Proposal | None:
        """The next trial to run, or None when the search is over."""
        if len(self.results) >= self.max_trials:
            return None
        if not self._remeasuring:
            # The last trials of the budget go to re-measuring the best two.
            reserve = min(REMEASURED, len(self.ranking()))
            if len(self.results) < self.max_trials - reserve:
                for family in self.families():
                    proposal = self._next_in_family(*family)
                    if proposal is not None:
                        return proposal
            self._remeasuring = True
        for config, _ in self.ranking()[:REMEASURED]:
            if len(self.scores(config)) == 1:
                return Proposal(config, "remeasure", self.predicted(config))
        return None

    def _tried(self, stage: int, checkpointing: bool) -> dict[int, TrialResult]:
        return {
            r.config.micro_batch: r
            for r in self.results
            if (r.config.stage, r.config.checkpointing) == (stage, checkpointing)
        }

    def _next_in_family(self, stage: int, checkpointing: bool) -> Proposal | None:
        family = (stage, checkpointing)
        if family in self._given_up:
            return None
        tried = self._tried(stage, checkpointing)
        oom_at = self._oom_at.get(family)
        fitting = [
            m
            for m in self.space.micro_batches()
            if (oom_at is None or m < oom_at)
            and self.fits(self.space.config(stage, checkpointing, m))
        ]
        reached = self._reached_by_cheaper(family)
        if fitting and not tried and max(fitting) <= reached:
            self._skip(family, max(fitting), reached)
            return None
        ok = [m for m, r in tried.items() if r.outcome == OK]
        above = [m for m in fitting if m > max(ok, default=0) and m not in tried]
        if above:
            return self._propose(stage, checkpointing, max(above))
        if not ok:
            return None
        return self._step_down(family, fitting, tried, max(ok))

    def _reached_by_cheaper(self, family: tuple[int, bool]) -> int:
        """The largest micro-batch that ran ok in a cheaper family (0: none). Checkpointing
        costs recomputation and sharding costs communication: each pays only where it fits a
        larger micro-batch than the cheaper ways already reached."""
        stage, checkpointing = family
        cheaper = [
            (s, c)
            for s in self.space.stages()
            for c in self.space.checkpointing()
            if s <= stage and c <= checkpointing and (s, c) != family
        ]
        return max(
            (m for key in cheaper for m, r in self._tried(*key).items() if r.outcome == OK),
            default=0,
        )

    def _step_down(
        self,
        family: tuple[int, bool],
        fitting: list[int],
        tried: dict[int, TrialResult],
        largest_ok: int,
    ) -> Proposal | None:
        """Step down from the largest ok micro-batch: only from a near-full one (or for
        latency), and on only while each step down was faster than the one above it."""
        chain = [largest_ok]
        while True:
            current = tried[chain[-1]]
            if len(chain) == 1:
                if not self._near_full(current) and self.metric != LATENCY:
                    return None
            elif current.value(self.metric) <= tried[chain[-2]].value(self.metric):
                return None
            lower = [m for m in fitting if m < chain[-1]]
            if not lower:
                return None
            below = max(lower)
            if below not in tried:
                return self._propose(family[0], family[1], below)
            if tried[below].outcome != OK:
                return None
            chain.append(below)

    def _skip(self, family: tuple[int, bool], fits: int, reached: int) -> None:
        if family not in self._given_up:
            self._given_up.add(family)
            config = self.space.config(family[0], family[1], fits)
            what = config.strategy + (" with checkpointing" if family[1] else "")
            self.decisions.append(
                f"{what}: skipped, it fits micro-batch {fits} at most and a cheaper strategy "
                f"reached {reached}"
            )

    def _near_full(self, result: TrialResult) -> bool:
        peak = result.peak_memory_bytes
        return (
            self.memory_cap is not None and peak is not None and peak >= NEAR_FULL * self.memory_cap
        )

    def _propose(self, stage: int, checkpointing: bool, micro_batch: int) -> Proposal:
        config = self.space.config(stage, checkpointing, micro_batch)
        return Proposal(config, "search", self.predicted(config))
