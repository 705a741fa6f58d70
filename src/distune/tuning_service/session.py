"""One model's tuning session: the state machine that turns report windows into groups.

``warmup`` -> ``sampling`` -> ``completed``, decided from the reports and their ``seconds``
only, never a clock. docs/tuning_service.md ("The session") states the rules once: what a
sample is, stalled windows, how the next group is chosen, confirmation and completion.

A session is not thread-safe: the service holds a lock per session, and readers take the
immutable :class:`SessionView` published after every change. ``report(..., decide=False)``
leaves the next group's choice (a Gaussian-process fit) pending for the service's worker
(:meth:`TuningSession.choose_next`, then :meth:`TuningSession.apply` under the lock); windows
reported meanwhile are not scored, so the choices equal those ``decide=True`` makes inline.
"""

from __future__ import annotations

import enum
import logging
import math
import statistics
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from distune.errors import DistuneError
from distune.space import FixedKnobs, Hyperparameters, ModelFacts, SearchSpace
from distune.tuning_service.config import TuningConfig
from distune.tuning_service.messages import Report, RequestError
from distune.tuning_service.optimizer import GroupOptimizer
from distune.tuning_service.score import Window, bounded, robust_throughput, split_stalls

logger = logging.getLogger(__name__)


class State(str, enum.Enum):
    """Where a session is."""

    WARMUP = "warmup"
    SAMPLING = "sampling"
    COMPLETED = "completed"


class Phase(str, enum.Enum):
    """Why a group was measured (the log's ``phase`` column)."""

    DEFAULT = "default"
    INITIAL = "initial"
    BAYES = "bayes"
    CONFIRM = "confirm"
    #: Not a sample: the log row of the final choice.
    COMPLETED = "completed"


@dataclass(frozen=True)
class Group:
    """A group handed out to a job: an id (new for every sample) and its hyperparameters."""

    id: int
    hyperparameters: Hyperparameters

    def to_dict(self) -> dict[str, Any]:
        """The REST API's ``G``."""
        return {"id": self.id, "hyperparameters": self.hyperparameters.to_dict()}


@dataclass(frozen=True)
class Reply:
    """What the job is told after registering, reporting or asking: the group to run."""

    group: Group
    state: State

    @property
    def completed(self) -> bool:
        """Whether tuning is over: the group will not change again."""
        return self.state is State.COMPLETED

    def to_dict(self) -> dict[str, Any]:
        """The REST API's reply body."""
        return {
            "group": self.group.to_dict(),
            "state": self.state.value,
            "completed": self.completed,
        }


@dataclass(frozen=True)
class SampleRecord:
    """One measured sample (or, with phase ``completed``, the final choice): a log row.

    ``score`` is the sample's robust throughput (for the final row, the chosen group's score
    over all its windows); ``gain_vs_default`` compares it with the default group's score.
    ``seconds``, ``iterations`` and ``windows`` count the scored windows only;
    ``invalid_windows`` counts the stalled windows set aside.
    """

    model: str
    sample: int
    group: Group
    phase: Phase
    score: float
    train_iter: int
    seconds: float
    iterations: int
    windows: int
    gain_vs_default: float
    invalid_windows: int = 0


@dataclass(frozen=True)
class Best:
    """The group the session would choose now (its choice, once completed): the best robust
    score among the confirmed groups (measured in two samples or more), or among all groups
    while none is confirmed."""

    group: Group
    score: float
    gain_vs_default: float

    def to_dict(self) -> dict[str, Any]:
        """The ``best`` object of ``/status``."""
        return {
            "group": self.group.to_dict(),
            "score": self.score,
            "gain_vs_default": self.gain_vs_default,
        }


@dataclass(frozen=True)
class SessionView:
    """An immutable snapshot of a session, published after every change."""

    name: str
    state: State
    current: Group
    samples: int
    max_samples: int
    best: Best | None
    default_score: float | None
    records: tuple[SampleRecord, ...]
    #: Stalled windows set aside so far, over every sample.
    invalid_windows: int = 0

    @property
    def reply(self) -> Reply:
        """The reply for the current group."""
        return Reply(self.current, self.state)

    def to_status(self) -> dict[str, Any]:
        """This model's entry in ``/status``."""
        return {
            "state": self.state.value,
            "samples": self.samples,
            "max_samples": self.max_samples,
            "current": self.current.to_dict(),
            "best": None if self.best is None else self.best.to_dict(),
            "default_score": self.default_score,
            "invalid_windows": self.invalid_windows,
        }


class StaleGroupError(DistuneError):
    """A report names a group that is not current; it is counted and ignored."""

    def __init__(self, group_id: int, reply: Reply) -> None:
        super().__init__(
            f"group_id: group {group_id} is not current; the current group is {reply.group.id}"
        )
        self.reply = reply


@dataclass
class _Windows:
    """Scored windows (merged in pairs past the session's ``max_windows``) and how many
    stalled ones were set aside."""

    windows: list[Window] = field(default_factory=list)
    invalid: int = 0

    @property
    def seconds(self) -> float:
        return sum(w.seconds for w in self.windows)

    @property
    def iterations(self) -> int:
        return sum(w.iterations for w in self.windows)

    @property
    def reports(self) -> int:
        return sum(w.reports for w in self.windows)

    @property
    def score(self) -> float:
        return robust_throughput([w.rate for w in self.windows])


@dataclass
class _Measurements(_Windows):
    """Every scored window of one group, across its samples."""

    samples: int = 0


@dataclass(kw_only=True)
class _Sample(_Windows):
    """The sample being measured: the current group's windows so far."""

    group: Group
    phase: Phase


class TuningSession:
    """The tuning state machine of one model (see the module's docstring).

    Creating a session is the model's first registration: the default group is handed out.
    """

    def __init__(
        self, name: str, facts: ModelFacts, fixed: FixedKnobs, config: TuningConfig
    ) -> None:
        self.name = name
        self.facts = facts
        self.fixed = fixed
        self.config = config
        self.space = SearchSpace.for_model(facts, fixed, config.default_bucket_size)
        self._optimizer = (
            GroupOptimizer(
                self.space, config.optimizer, _model_seed(config.seed, name), config.max_samples
            )
            if self.space.tuned
            else None
        )
        self._state = State.WARMUP if config.warmup_time > 0 else State.SAMPLING
        self._warmup_seconds = 0.0
        self._group = Group(0, self.space.default)
        self._sample = _Sample(group=self._group, phase=Phase.DEFAULT)
        # The first window after a registration or a switch is discarded: it holds the cost of
        # starting up or of applying the switch, not the group's throughput.
        self._discard_next = True
        self._counts_samples: bool | None = None
        self._measurements: dict[Hyperparameters, _Measurements] = {}
        self._records: list[SampleRecord] = []
        self._best: Best | None = None
        self._converged = False
        self._invalid_windows = 0
        # train_iter of the report that finished the sample whose successor is being chosen.
        self._pending: int | None = None
        self.stale_reports = 0
        self.view = self._make_view()

    @property
    def deciding(self) -> bool:
        """Whether a finished sample awaits the choice of the next group (see the module)."""
        return self._pending is not None

    def register(self) -> Reply:
        """A re-registration (a restarted job): tuning resumes where it was. The next window
        is discarded, since it holds the restart."""
        if self._state is not State.COMPLETED:
            self._discard_next = True
        return self.view.reply

    def report(self, report: Report, decide: bool = True) -> tuple[Reply, list[SampleRecord]]:
        """Account one report window; returns the reply and the log rows it produced (a finished
        sample, and the final choice if the session completed). With ``decide`` False, a
        finished sample leaves the next group to :meth:`choose_next` and :meth:`apply`.

        Raises StaleGroupError for a group that is not current, and RequestError for a window
        that counts samples where earlier ones did not (or the other way around).
        """
        if report.group_id != self._group.id:
            self.stale_reports += 1
            raise StaleGroupError(report.group_id, self.view.reply)
        if self._state is State.COMPLETED or self._pending is not None:
            return self.view.reply, []  # nothing left to measure, or the sample is over
        if self._state is State.WARMUP:
            self._discard_next = False  # warmup ignores windows anyway
            self._warmup_seconds += report.seconds
            if self._warmup_seconds >= self.config.warmup_time:
                self._state = State.SAMPLING
                self.view = self._make_view()
            return self.view.reply, []
        if self._discard_next:
            self._discard_next = False
            return self.view.reply, []
        counts_samples = report.samples is not None
        if self._counts_samples is None:
            self._counts_samples = counts_samples
        elif counts_samples != self._counts_samples:
            unit = "samples" if self._counts_samples else "iterations"
            raise RequestError(
                "samples",
                f"model {self.name!r} is scored in {unit} per second: "
                "give samples in every report or in none",
            )
        sample = self._sample
        count = report.iterations if report.samples is None else report.samples
        sample.windows.append(Window(count, report.iterations, report.seconds))
        if len(sample.windows) > self.config.max_windows:
            self._set_stalls_aside()  # before merging, which would blur them into their neighbours
            sample.windows = bounded(sample.windows, self.config.max_windows)
        if not self._sample_complete():
            return self.view.reply, []
        # Stalls are judged once the sample looks complete, when the most evidence is in; the
        # windows they leave must then still make a complete sample.
        self._set_stalls_aside()
        if not self._sample_complete():
            return self.view.reply, []
        records = self._finish_sample(report.train_iter)
        if decide:
            records += self.apply(self.choose_next())
        return self.view.reply, records

    def choose_next(self) -> tuple[Hyperparameters, Phase] | None:
        """The group to sample after the finished one and why, or None to complete; may fit
        the Gaussian process. Reads and changes only what reports leave alone while a choice
        is pending, so it may run outside the session's lock; give the result to :meth:`apply`.
        """
        if self._pending is None:
            raise RuntimeError(f"model {self.name}: no finished sample awaits a choice")
        return self._next_sample()

    def apply(self, choice: tuple[Hyperparameters, Phase] | None) -> list[SampleRecord]:
        """Switch to the chosen group, or complete (the returned log row is the final choice)."""
        if self._pending is None:
            raise RuntimeError(f"model {self.name}: no finished sample awaits a choice")
        train_iter, self._pending = self._pending, None
        records = []
        if choice is None:
            final = self._complete(train_iter)
            self._records.append(final)
            records.append(final)
        else:
            hp, phase = choice
            self._group = Group(self._group.id + 1, hp)
            self._sample = _Sample(group=self._group, phase=phase)
            self._discard_next = True
        self.view = self._make_view()
        return records

    def _sample_complete(self) -> bool:
        sample = self._sample
        return (
            sample.seconds >= self.config.sampling_confidence_time
            and sample.reports >= self.config.min_windows
        )

    def _set_stalls_aside(self) -> None:
        """Drop the current sample's stalled windows (see :func:`split_stalls`), compared with
        the group's windows in this sample and earlier ones."""
        sample = self._sample
        earlier = self._measurements.get(sample.group.hyperparameters)
        reference = [] if earlier is None else [w.rate for w in earlier.windows]
        valid, stalled = split_stalls(sample.windows, reference, self.config.stall_fraction)
        if stalled:
            sample.windows = valid
            dropped = sum(w.reports for w in stalled)
            sample.invalid += dropped
            self._invalid_windows += dropped
            self.view = self._make_view()
            logger.info(
                "model %s group %d: %d stalled window(s) not scored (%s/s against a median "
                "near %.4g/s)",
                self.name,
                sample.group.id,
                dropped,
                ", ".join(f"{w.rate:.4g}" for w in stalled[:5]),
                statistics.median([*reference, *(w.rate for w in valid)]),
            )

    def _finish_sample(self, train_iter: int) -> list[SampleRecord]:
        sample = self._sample
        hp = sample.group.hyperparameters
        score = sample.score
        measured = self._measurements.setdefault(hp, _Measurements())
        measured.windows = bounded(measured.windows + sample.windows, self.config.max_windows)
        measured.invalid += sample.invalid
        measured.samples += 1
        if self._optimizer is not None and not self._converged:
            # The optimizer sees each group's pooled score: a re-measurement refines it.
            try:
                self._optimizer.tell(hp, measured.score)
            except Exception:
                self._stop_searching()
        default_score = self._measurements[self.space.default].score
        records = [
            SampleRecord(
                model=self.name,
                sample=len(self._records) + 1,
                group=sample.group,
                phase=sample.phase,
                score=score,
                train_iter=train_iter,
                seconds=sample.seconds,
                iterations=sample.iterations,
                windows=sample.reports,
                gain_vs_default=score / default_score - 1.0,
                invalid_windows=sample.invalid,
            )
        ]
        self._records += records
        self._best = self._best_so_far()
        self._pending = train_iter
        self.view = self._make_view()
        return records

    def _best_so_far(self) -> Best:
        """The group the session would choose now: the best pooled score among the confirmed
        groups (measured in at least two samples), or among all while none is. A group
        measured once can be high by luck (the best of many noisy samples is biased upwards);
        when the budget runs out after confirmations knocked the leaders down, such a group
        must not win over one whose score has survived a second look."""
        default_score = self._measurements[self.space.default].score
        confirmed = {hp: m for hp, m in self._measurements.items() if m.samples >= 2}
        candidates = confirmed or self._measurements
        hp, measured = max(candidates.items(), key=lambda item: item[1].score)
        group = self._latest_group(hp)
        return Best(group, measured.score, measured.score / default_score - 1.0)

    def _latest_group(self, hp: Hyperparameters) -> Group:
        if self._group.hyperparameters == hp:
            return self._group
        return next(r.group for r in reversed(self._records) if r.group.hyperparameters == hp)

    def _complete(self, train_iter: int) -> SampleRecord:
        assert self._best is not None
        hp = self._best.group.hyperparameters
        if self._group.hyperparameters != hp:
            self._group = Group(self._group.id + 1, hp)
        self._best = Best(self._group, self._best.score, self._best.gain_vs_default)
        self._state = State.COMPLETED
        measured = self._measurements[hp]
        return SampleRecord(
            model=self.name,
            sample=len(self._records),
            group=self._group,
            phase=Phase.COMPLETED,
            score=self._best.score,
            train_iter=train_iter,
            seconds=measured.seconds,
            iterations=measured.iterations,
            windows=measured.reports,
            gain_vs_default=self._best.gain_vs_default,
            invalid_windows=measured.invalid,
        )

    def _contenders_to_confirm(self) -> list[Hyperparameters]:
        """The best group and its runners-up within the margin, if measured only once."""
        ranked = sorted(self._measurements.items(), key=lambda item: item[1].score, reverse=True)
        floor = ranked[0][1].score * (1.0 - self.config.confirm_margin)
        contenders = [hp for hp, m in ranked[: self.config.confirm_top] if m.score >= floor]
        return [hp for hp in contenders if self._measurements[hp].samples < 2]

    def _next_sample(self) -> tuple[Hyperparameters, Phase] | None:
        """The next group to sample and why, or None to complete (see the module docstring)."""
        if self._optimizer is None:
            return None  # nothing to tune: the default group's score is all there is to know
        remaining = self.config.max_samples - len(self._records)
        to_confirm = self._contenders_to_confirm()
        # With confirmation on, the last sample never explores: what it found would win
        # unconfirmed. Contenders are confirmed best first, so the winner is confirmed first.
        last = 1 if self.config.confirm_top else 0
        may_explore = remaining > max(last, len(to_confirm))
        if to_confirm and remaining > 0 and (self._converged or not may_explore):
            return to_confirm[0], Phase.CONFIRM
        if self._converged or not may_explore:
            return self._default_to_confirm(remaining)
        try:
            suggestion = self._optimizer.suggest()
        except Exception:
            self._stop_searching()
            return self._next_sample()
        settings = self.config.optimizer
        if suggestion is not None:
            improvement = suggestion.expected_improvement
            if improvement is None:
                return suggestion.hyperparameters, Phase.INITIAL
            if (
                improvement >= settings.stop_improvement
                or len(self._measurements) < self._stop_min_groups
            ):
                return suggestion.hyperparameters, Phase.BAYES
        self._converged = True  # every group measured, or nothing left worth measuring
        return self._next_sample()

    def _default_to_confirm(self, remaining: int) -> tuple[Hyperparameters, Phase] | None:
        """The default group again, if another group is about to be chosen over it on one
        sample of the default and budget remains; None: complete.

        The default's only sample is the job's first after warmup, which can be slow for
        reasons of its own (caches, the allocator, ranks still settling), and the chosen group's
        pooled score is the best of many: set against that one sample, the gain reported to the
        user overstates the true one (docs/tuning_service.md has the figures)."""
        default = self.space.default
        assert self._best is not None
        if (
            self.config.confirm_top
            and remaining > 0
            and self._best.group.hyperparameters != default
            and self._measurements[default].samples < 2
        ):
            return default, Phase.CONFIRM
        return None

    @property
    def _stop_min_groups(self) -> int:
        """Groups to measure before the search may stop early. A share of the budget as well
        as a fixed floor: on a flat landscape whose best group stands out by a few percent,
        the GP has no reason to look for it, and a long budget is what lets the search find
        it (docs/tuning_service.md has the figures)."""
        settings = self.config.optimizer
        share = math.ceil(settings.stop_min_share * self.config.max_samples)
        return max(settings.stop_min_groups, share)

    def _stop_searching(self) -> None:
        # A numerical failure of the optimizer must not take the job's tuning down with it:
        # the search ends and the session chooses among the groups measured so far.
        logger.exception(
            "model %s: the optimizer failed; choosing among measured groups", self.name
        )
        self._converged = True

    def _make_view(self) -> SessionView:
        default = self._measurements.get(self.space.default)
        return SessionView(
            name=self.name,
            state=self._state,
            current=self._group,
            samples=sum(r.phase is not Phase.COMPLETED for r in self._records),
            max_samples=self.config.max_samples,
            best=self._best,
            default_score=None if default is None else default.score,
            records=tuple(self._records),
            invalid_windows=self._invalid_windows,
        )


def _model_seed(seed: int | None, name: str) -> int | None:
    """A seed per model, so two models of one job explore independently but reproducibly."""
    if seed is None:
        return None
    return int(np.random.SeedSequence([seed, zlib.crc32(name.encode())]).generate_state(1)[0])
