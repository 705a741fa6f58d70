"""One model's tuning session: the state machine that turns report windows into groups.

``warmup`` -> ``sampling`` -> ``completed``, decided from the reports and their ``seconds``
only, never a clock. docs/tuning_service.md ("The session") states the rules once: what a
sample is, stalled windows, hopeless samples ended early, how the next group is chosen,
confirmation, the gain's interval and completion, and the reopening on drift.

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
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from scipy.stats import t as student_t

from distune.errors import DistuneError
from distune.space import FixedKnobs, Hyperparameters, ModelFacts, SearchSpace
from distune.tuning_service.config import TuningConfig
from distune.tuning_service.messages import Report, RequestError
from distune.tuning_service.optimizer import GroupOptimizer
from distune.tuning_service.score import (
    Window,
    bounded,
    robust_throughput,
    split_stalls,
    trimmed_variance_factor,
)

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

    ``sample`` is the sample's number in the budget: a close call's legs, each a row, share
    their sample's. ``score`` is the sample's robust throughput (for the final row, the chosen
    group's score over all its windows); ``gain_vs_default`` compares it with the default
    group's score.
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
    #: Half-width of the 95% interval of ``gain_vs_default`` (None: not enough windows).
    gain_margin: float | None = None
    #: The sample ended early: its first windows were clearly slower than the best group's.
    ended_early: bool = False
    #: On the final row: why the choice is what it is, for people (e.g. no measurable gain).
    note: str = ""


@dataclass(frozen=True)
class Best:
    """The group the session would choose now (its choice, once completed): the best robust
    score among the confirmed groups (measured in two samples or more), or among all groups
    while none is confirmed."""

    group: Group
    score: float
    gain_vs_default: float
    #: Half-width of the confidence interval (``gain_confidence``) of ``gain_vs_default``,
    #: from the windows of the group and of the default group (None: too few windows).
    gain_margin: float | None = None
    #: The interval itself, ``(low, high)``; None with ``gain_margin``.
    gain_interval: tuple[float, float] | None = None

    @property
    def measurably_faster(self) -> bool:
        """Whether the gain's interval lies above zero."""
        return self.gain_interval is not None and self.gain_interval[0] > 0

    def to_dict(self) -> dict[str, Any]:
        """The ``best`` object of ``/status``."""
        return {
            "group": self.group.to_dict(),
            "score": self.score,
            "gain_vs_default": self.gain_vs_default,
            "gain_margin": self.gain_margin,
            "gain_interval": None if self.gain_interval is None else list(self.gain_interval),
            "measurably_faster": self.measurably_faster,
        }


@dataclass(frozen=True)
class SessionView:
    """An immutable snapshot of a session, published after every change."""

    name: str
    state: State
    current: Group
    #: Samples of the budget done (a close call's legs count once, when their sample ends).
    samples: int
    max_samples: int
    best: Best | None
    default_score: float | None
    records: tuple[SampleRecord, ...]
    #: Stalled windows set aside so far, over every sample.
    invalid_windows: int = 0
    #: Once completed: what the choice means for people ("no group measurably faster than the
    #: default: differences within ±X%", or the gain and its interval).
    verdict: str | None = None
    #: Times the session reopened because the throughput drifted below the choice's score.
    retunes: int = 0

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
            "verdict": self.verdict,
            "retunes": self.retunes,
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
        return _score(self.windows)


@dataclass
class _Measurements(_Windows):
    """Every scored window of one group, across its samples."""

    samples: int = 0
    #: Each sample's log score and report count: how far samples of one group disagree
    #: beyond their windows' noise (the job's conditions drift between samples).
    sample_means: list[tuple[float, int]] = field(default_factory=list)
    #: The windows of the samples after the first. A group is confirmed because its first
    #: sample scored high, which is partly luck (the best of many noisy scores); its gain is
    #: claimed from these windows alone, which that selection did not see.
    confirming: list[Window] = field(default_factory=list)

    #: The trimmed means of ``windows`` and of the judged windows, kept as they change
    #: (:meth:`add`): they are read at every window and every claim.
    _scores: tuple[float, float] = (math.nan, math.nan)

    def add(self, sample: _Sample, max_windows: int) -> None:
        """Pool a finished sample's windows (merged in pairs past ``max_windows``)."""
        self.windows = bounded(self.windows + sample.windows, max_windows)
        if self.samples:
            self.confirming = bounded(self.confirming + sample.windows, max_windows)
        self.invalid += sample.invalid
        self.samples += 1
        if sample.windows:
            # The sample's own robust score: a stall in one window moves it no more than the
            # score the group is judged by.
            self.sample_means.append((math.log(sample.score), sample.reports))
        if self.windows:
            self._scores = (_score(self.windows), _score(self.judged()[0]))

    @property
    def score(self) -> float:
        """The trimmed mean of every window of the group."""
        return self._scores[0]

    @property
    def judged_score(self) -> float:
        """The trimmed mean of the windows a gain is judged by (:meth:`judged`)."""
        return self._scores[1]

    def judged(self) -> tuple[list[Window], int]:
        """The windows a gain is judged by, and how many samples they come from: the
        confirming ones once there are any (the first sample left out), else all."""
        if self.confirming:
            return self.confirming, self.samples - 1
        return self.windows, self.samples


@dataclass(kw_only=True)
class _Sample(_Windows):
    """The sample being measured: the current group's windows so far."""

    group: Group
    phase: Phase
    ended_early: bool = False
    #: The window right after the switch to this sample (or the registration): not scored,
    #: but it tells what a switch costs once the group's score is known.
    switch: Window | None = None
    #: The sample is a leg of a close call (see ``TuningSession._begin_legs``): it lasts
    #: ``close_call_time`` / legs times the sampling time and windows.
    close_call: bool = False


@dataclass(frozen=True)
class _Noise:
    """What the measurements say of their noise, in log rate: a window's standard deviation,
    the samples' own spread beyond it, and the degrees of freedom that spread rests on."""

    window: float
    sample: float
    freedom: float


#: A window's noise (standard deviation of its log rate) assumed before any group has two.
_PRIOR_WINDOW_SIGMA = 0.05
#: The least window noise assumed, however quiet the measurements look.
_MIN_WINDOW_SIGMA = 0.005
#: The between-sample spread's prior guess, as a share of the window noise, and how many
#: degrees of freedom it is worth (TuningSession._sample_sigma; chosen on the training draw,
#: docs/tuning_service.md "The final comparison's statistics").
_SAMPLE_PRIOR_SHARE = 0.25
_SAMPLE_PRIOR_FREEDOM = 2.0
#: The level a close call's gain must reach at an interim look (any before the budget is
#: spent) to end it early: Haybittle and Peto's 3.29 standard deviations. The final look, at
#: the budget's end, is at ``gain_confidence``; interim looks this strict leave its error rate
#: about as it is, where looks at ``gain_confidence`` each would add theirs up.
_INTERIM_CONFIDENCE = 0.999
#: The median absolute deviation of normal noise times this is its standard deviation.
_MAD_TO_SIGMA = 1.4826
#: A switch window is judged less this many times the dearest switch measured so far.
_SWITCH_ALLOWANCE = 2.0


class TuningSession:
    """The tuning state machine of one model (see the module's docstring).

    Creating a session is the model's first registration (or its first with these facts):
    the default group is handed out, with id ``first_group_id``.
    """

    def __init__(
        self,
        name: str,
        facts: ModelFacts,
        fixed: FixedKnobs,
        config: TuningConfig,
        first_group_id: int = 0,
    ) -> None:
        self.name = name
        self.facts = facts
        self.fixed = fixed
        self.config = config
        self.space = SearchSpace.for_model(facts, fixed, config.default_bucket_size)
        self._optimizer = (
            GroupOptimizer(self.space, config.optimizer, _model_seed(config.seed, name))
            if self.space.tuned
            else None
        )
        self._state = State.WARMUP if config.warmup_time > 0 else State.SAMPLING
        self._warmup_seconds = 0.0
        # A model registered again with other facts gets a new session whose ids continue the
        # old one's, so a report names the session it belongs to (docs/tuning_service.md).
        self._group = Group(first_group_id, self.space.default)
        self._sample = _Sample(group=self._group, phase=Phase.DEFAULT)
        # The first window after a registration or a switch is discarded: it holds the cost of
        # starting up or of applying the switch, not the group's throughput.
        self._discard_next = True
        self._counts_samples: bool | None = None
        self._measurements: dict[Hyperparameters, _Measurements] = {}
        # What the measurements say of the noise; None: to compute (see _noise).
        self._noise_cache: _Noise | None = None
        self._records: list[SampleRecord] = []
        self._best: Best | None = None
        self._converged = False
        self._invalid_windows = 0
        # The most a switch has cost (seconds of a switch window beyond its group's speed);
        # None until one is measured. The registration's window counts until a switch is.
        self._switch_cost: float | None = None
        self._switch_cost_from_switches = False
        # train_iter of the report that finished the sample whose successor is being chosen.
        self._pending: int | None = None
        self._verdict: str | None = None
        # Samples of the budget spent (a close call's legs make one), and how many of them
        # came before the current round (a drift reopens the session for a new round).
        self._spent = 0
        self._round_start = 0
        self._round_budget = config.max_samples
        self._retunes = 0
        self._drift_seconds = 0.0
        self._after_default: list[Hyperparameters] = []
        # A close call's budget sample in progress: the two groups it alternates and how many
        # of its legs are still to measure.
        self._legs: tuple[Hyperparameters, Hyperparameters] | None = None
        self._legs_left = 0
        # The pairs of groups that have met in a close call, and the other group of a close
        # call between two confirmed groups that _next_sample chose, for apply to begin.
        self._met: set[frozenset[Hyperparameters]] = set()
        self._partner: Hyperparameters | None = None
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
        if self._state is State.COMPLETED:
            self._watch_drift(report)
            return self.view.reply, []
        if self._pending is not None:
            return self.view.reply, []  # the sample is over
        if self._state is State.WARMUP:
            self._account_warmup(report)
            return self.view.reply, []
        if not self._account(report):
            return self.view.reply, []
        records = self._finish_sample(report.train_iter)
        if decide:
            records += self.apply(self.choose_next())
        return self.view.reply, records

    def _account(self, report: Report) -> bool:
        """Add a report's window to the current sample; returns whether the sample is over."""
        sample = self._sample
        count = report.iterations if report.samples is None else report.samples
        window = Window(count, report.iterations, report.seconds)
        if self._discard_next:
            self._discard_next = False
            sample.switch = window
            if not self._hopeless(window):
                return False
            self._check_unit(report)
            sample.windows.append(window)  # the sample is scored with the one window it has
            sample.ended_early = True
            return True
        self._check_unit(report)
        sample.windows.append(window)
        if len(sample.windows) > self.config.max_windows:
            self._set_stalls_aside()  # before merging, which would blur them into their neighbours
            sample.windows = bounded(sample.windows, self.config.max_windows)
        if self._clearly_worse():
            sample.ended_early = True
            return True
        if not self._sample_complete():
            return False
        # Stalls are judged once the sample looks complete, when the most evidence is in; the
        # windows they leave must then still make a complete sample.
        self._set_stalls_aside()
        return self._sample_complete()

    def _account_warmup(self, report: Report) -> None:
        self._discard_next = False  # warmup ignores windows anyway
        if self._sample.switch is None:  # the job's first window: what starting up costs
            count = report.iterations if report.samples is None else report.samples
            self._sample.switch = Window(count, report.iterations, report.seconds)
        self._warmup_seconds += report.seconds
        if self._warmup_seconds >= self.config.warmup_time:
            self._state = State.SAMPLING
            self.view = self._make_view()

    def _check_unit(self, report: Report) -> None:
        """A model is scored in samples or in iterations per second, the same in every report."""
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
            partner, self._partner = self._partner, None
            close_call = (
                bool(self._legs_left)
                or partner is not None
                or (phase is Phase.CONFIRM and self._close_call(hp))
            )
            if close_call and not self._legs_left:
                hp = self._begin_legs(hp, partner)
            self._group = Group(self._group.id + 1, hp)
            self._sample = _Sample(group=self._group, phase=phase, close_call=close_call)
            self._discard_next = True
        self.view = self._make_view()
        return records

    def _hopeless(self, switch: Window) -> bool:
        """Whether an exploring sample is hopeless from its switch window alone: even less
        twice the dearest switch measured so far, the window ran ``hopeless_slowdown`` times
        slower than the best group's score. A switch window is one iteration (the worker's
        schedule), so the job has lost little; the judgement waits until a switch's cost is
        known (the registration's window stands in for it until then)."""
        config = self.config
        if (
            config.hopeless_slowdown == 0
            or self._sample.phase not in (Phase.INITIAL, Phase.BAYES)
            or self._best is None
            or self._switch_cost is None
        ):
            return False
        working = switch.seconds - _SWITCH_ALLOWANCE * self._switch_cost
        return working > config.hopeless_slowdown * switch.count / self._best.score

    def _learn_switch_cost(self, sample: _Sample, score: float) -> None:
        """What the sample's switch window cost beyond its group's speed, once the score is
        known; the registration's window counts only until a real switch is measured."""
        if sample.switch is None or any(w is sample.switch for w in sample.windows):
            return  # no switch window, or the sample was scored with it
        cost = max(0.0, sample.switch.seconds - sample.switch.count / score)
        is_switch = sample.phase is not Phase.DEFAULT or bool(self._records)
        if is_switch and not self._switch_cost_from_switches:
            self._switch_cost, self._switch_cost_from_switches = cost, True
        elif is_switch or self._switch_cost is None:
            self._switch_cost = max(cost, self._switch_cost or 0.0)

    def _clearly_worse(self) -> bool:
        """Whether the sample so far is hopeless: an exploring sample with its first
        ``early_end_windows`` windows, whose *fastest* window is ``early_end_z`` standard
        deviations (of the difference between a window and the best group's mean log rate)
        below the best group's score. The fastest window, not the mean: a stall only slows a
        window, so a group is never ended early for one stalled window, and all its windows
        must be slow."""
        sample, config = self._sample, self.config
        if (
            config.early_end_windows == 0
            or sample.phase not in (Phase.INITIAL, Phase.BAYES)
            or self._best is None
            or sample.reports < config.early_end_windows
        ):
            return False
        best = self._measurements[self._best.group.hyperparameters]
        fastest = max(math.log(w.rate) for w in sample.windows)
        sigma = self._window_sigma() * math.sqrt(1.0 + 1.0 / best.reports)
        return fastest < math.log(best.score) - config.early_end_z * sigma

    def _noise(self) -> _Noise:
        """The window noise and the samples' spread (:meth:`_pooled_window_sigma`,
        :meth:`_sample_sigma`): both depend on the measurements alone, so they are computed
        once after each change of them (a finished sample, a reopening), not at every window
        and every claim, which made a long close call's session quadratic in its windows."""
        if self._noise_cache is None:
            window = self._pooled_window_sigma()
            self._noise_cache = _Noise(window, *self._sample_sigma(window))
        return self._noise_cache

    def _window_sigma(self) -> float:
        """The standard deviation of a window's log rate (:meth:`_pooled_window_sigma`)."""
        return self._noise().window

    def _pooled_window_sigma(self) -> float:
        """The standard deviation of one report window's log rate about its group's mean,
        pooled over every measured group (a prior guess until one has two windows). Robust:
        the median absolute deviation, each deviation scaled to one report's variance, so a
        stall in a short sample does not make every difference look like noise.

        A window merged from ``r`` reports (past ``max_windows``) varies ``r`` times less than
        one report; about the group's mean weighted by reports (``R`` of them), its deviation
        has variance ``sigma**2 * (1 / r - 1 / R)``, which the scaling divides out (for
        unmerged windows, the usual ``n / (n - 1)``)."""
        deviations: list[float] = []
        for measured in self._measurements.values():
            windows = measured.windows
            if len(windows) >= 2:
                total = measured.reports
                logs = [math.log(w.rate) for w in windows]
                mean = sum(w.reports * x for w, x in zip(windows, logs, strict=True)) / total
                deviations += [
                    abs(x - mean) / math.sqrt(1.0 / w.reports - 1.0 / total)
                    for w, x in zip(windows, logs, strict=True)
                ]
        if not deviations:
            return _PRIOR_WINDOW_SIGMA
        return max(_MIN_WINDOW_SIGMA, _MAD_TO_SIGMA * statistics.median(deviations))

    def _sample_sigma(self, window_sigma: float) -> tuple[float, float]:
        """The standard deviation of a sample's mean log rate beyond its windows' noise:
        pooled over every group measured in several samples (one-way analysis of variance),
        the spread of their sample means less what the window noise explains. Every group's
        first sample is left out, as from the gain (:meth:`_Measurements.judged`): a group
        other than the default was measured again because its first sample scored high,
        partly by luck, and the default's first sample is what the others were chosen over
        (and the job's first after warmup); either would inflate the spread. Unbiased:
        about their own centre, ``k`` sample means scatter by ``(k - 1) / k`` of their
        variances summed, the samples' spread and each one's window noise alike. A sample's
        window noise is over the reports it holds, merged or not.

        Regularised by a prior guess, ``_SAMPLE_PRIOR_SHARE`` of the window noise, worth
        ``_SAMPLE_PRIOR_FREEDOM`` degrees of freedom (the variances averaged by degrees of
        freedom, as a scaled inverse chi-square prior's posterior does). Until late in a
        session the estimate rests on few degrees of freedom: unregularised it was 0 in half
        the runs and, when one sample was lucky, large enough to make the interval ±20-35 %.
        With the prior it is neither; with more measurements (a close call's legs) the data
        outweigh it. Returns the standard deviation and the degrees of freedom it rests on,
        the prior's included."""
        excess, freedom = 0.0, 0
        for measured in self._measurements.values():
            means = measured.sample_means[1:]
            if len(means) >= 2:
                k = len(means)
                centre = statistics.fmean(m for m, _ in means)
                for mean, count in means:
                    noise = window_sigma**2 * trimmed_variance_factor(count) / count
                    excess += (mean - centre) ** 2 - noise * (k - 1) / k
                freedom += k - 1
        prior = (_SAMPLE_PRIOR_SHARE * window_sigma) ** 2
        weight = _SAMPLE_PRIOR_FREEDOM + freedom
        if not weight:
            return 0.0, 0.0
        return math.sqrt(max(0.0, (_SAMPLE_PRIOR_FREEDOM * prior + excess) / weight)), weight

    def _gain_interval(
        self,
        windows: list[Window],
        score: float,
        samples: int = 1,
        comparisons: int = 1,
        confidence: float | None = None,
    ) -> tuple[float, tuple[float, float]] | None:
        """The gain over the default group of a group scored ``score`` from ``windows`` (of
        ``samples`` samples), and its ``gain_confidence`` interval: the difference of the two
        log scores, with the pooled window noise over each side's report count (a window merged
        past ``max_windows`` holds several; times what the trimmed mean costs,
        :func:`trimmed_variance_factor`) and the samples' own spread over each side's sample
        count (None before the default has a score to compare with).

        ``comparisons``: the group was chosen as the best of this many candidates, each with
        its own interval; each is then widened to ``1 - (1 - gain_confidence) / comparisons``
        (Bonferroni), so that all of them, and so the chosen one's, hold the true gains with
        at least ``gain_confidence`` however the choice fell."""
        default = self._measurements.get(self.space.default)
        if default is None or not windows:
            return None
        # The default's first sample is left out as well once it has later ones: a group
        # became the best by scoring above it, so it is low by luck as often as not when a
        # gain is in question (and it is the job's first after warmup).
        base, base_samples = default.judged()
        if windows is base or windows is default.windows:
            return 0.0, (0.0, 0.0)
        delta = math.log(score) - math.log(default.judged_score)
        confidence = self.config.gain_confidence if confidence is None else confidence
        miss = (1.0 - confidence) / max(1, comparisons)
        noise = self._noise()
        window_sigma, sample_sigma, freedom = noise.window, noise.sample, noise.freedom
        window_part = window_sigma**2 * sum(
            trimmed_variance_factor(len(side)) / sum(w.reports for w in side)
            for side in (windows, base)
        )
        sample_part = sample_sigma**2 * (1.0 / samples + 1.0 / max(1, base_samples))
        variance = window_part + sample_part
        if sample_part > 0:
            # Welch-Satterthwaite: the window noise rests on many windows, the samples'
            # spread on few degrees of freedom.
            effective = freedom * (variance / sample_part) ** 2
            quantile = float(student_t.ppf(1.0 - miss / 2.0, effective))
        else:
            quantile = statistics.NormalDist().inv_cdf(1.0 - miss / 2.0)
        half = quantile * math.sqrt(variance)
        return math.expm1(delta), (math.expm1(delta - half), math.expm1(delta + half))

    def _sample_complete(self) -> bool:
        sample, config = self._sample, self.config
        length = config.sampling_confidence_time
        windows = config.min_windows
        if sample.close_call:
            # Longer in windows too: the interval narrows with the windows' count, and a model
            # whose iterations outlast the sampling time gets a few windows a sample whatever it.
            share = config.close_call_time / _legs_per_sample(config.close_call_time)
            length *= share
            windows = math.ceil(windows * share)
        return sample.seconds >= length and sample.reports >= windows

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
        measured.add(sample, self.config.max_windows)
        self._noise_cache = None  # the measurements changed
        self._learn_switch_cost(sample, score)
        if self._optimizer is not None and not self._converged:
            # The optimizer sees each group's pooled score: a re-measurement refines it.
            try:
                self._optimizer.tell(hp, measured.score)
            except Exception:
                self._stop_searching()
        default_score = self._measurements[self.space.default].judged_score
        interval = self._gain_interval(sample.windows, score)
        records = [
            SampleRecord(
                model=self.name,
                sample=self._spent + 1,
                group=sample.group,
                phase=sample.phase,
                score=score,
                train_iter=train_iter,
                seconds=sample.seconds,
                iterations=sample.iterations,
                windows=sample.reports,
                gain_vs_default=score / default_score - 1.0,
                invalid_windows=sample.invalid,
                gain_margin=None if interval is None else _half_width(interval[1]),
                ended_early=sample.ended_early,
            )
        ]
        self._records += records
        if self._legs_left:
            self._legs_left -= 1
        if not self._legs_left:
            self._spent += 1
            self._legs = None
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
        candidates = self._candidates()
        hp = max(candidates, key=lambda hp: candidates[hp].score)
        return self._claim(hp, candidates)

    def _candidates(self) -> dict[Hyperparameters, _Measurements]:
        """The groups the choice is made among: the confirmed ones, or all while none is."""
        confirmed = {hp: m for hp, m in self._measurements.items() if m.samples >= 2}
        return confirmed or self._measurements

    def _claim(
        self,
        hp: Hyperparameters,
        candidates: dict[Hyperparameters, _Measurements],
        confidence: float | None = None,
    ) -> Best:
        """``hp``'s score and gain over the default, with its interval (at ``confidence``;
        None: ``gain_confidence``). A group's are those of its confirming samples once it has
        any (the winner's curse, see :class:`_Measurements`). Those are a choice too, the best
        of the ``candidates``' pooled scores: its interval allows for the other candidates it
        was chosen over."""
        default = self.space.default
        comparisons = sum(other != default for other in candidates)
        measured = self._measurements[hp]
        windows, samples = measured.judged()
        score = measured.judged_score
        gain = self._gain_interval(windows, score, samples, comparisons, confidence)
        assert gain is not None  # the default group is measured first
        return Best(self._latest_group(hp), score, gain[0], _half_width(gain[1]), gain[1])

    def _challenger(self) -> Best | None:
        """The group whose gain over the default is in question: the best group; or, while
        the default leads, the best other group (a confirmed one, if any is) if its interval
        still reaches above zero. The default's lead can be luck as much as a group's: its
        first sample is as noisy as any, and a runner-up a few percent faster is then kept out
        by that alone (docs/tuning_service.md, "The final comparison's statistics")."""
        assert self._best is not None
        default = self.space.default
        if self._best.group.hyperparameters != default:
            return self._best
        measured = self._measurements
        others = [hp for hp in measured if hp != default]
        others = [hp for hp in others if measured[hp].samples >= 2] or others
        if not others:
            return None
        candidates = self._candidates()
        claim = self._claim(max(others, key=lambda hp: measured[hp].score), candidates)
        interval = claim.gain_interval
        return claim if interval is not None and interval[1] > 0 else None

    def _clearly_faster(self, challenger: Best) -> bool:
        """Whether ``challenger``'s gain is proven at the interim looks' stricter level
        (:data:`_INTERIM_CONFIDENCE`): only then does a close call end before the budget."""
        hp = challenger.group.hyperparameters
        if hp == self.space.default:
            return False
        return self._claim(hp, self._candidates(), _INTERIM_CONFIDENCE).measurably_faster

    def _close_call(self, hp: Hyperparameters) -> bool:
        """Whether a confirmation of ``hp`` is a close call's sample (``close_call_time`` times
        as long, in legs): one of the challenger or of the default while the challenger's gain
        is not proven at the interim level. The budget counts samples, and a leg of the
        challenger costs little while tuning. So is the budget's last sample when it confirms
        another group whose gain is not proven at that level (a runner-up scored above the
        challenger): a plain sample of a few windows could not prove a gain of a few percent,
        and an unproven group is never chosen over the default, so the last sample would
        decide nothing; in legs against the default it can."""
        if self._best is None:
            return False
        challenger = self._challenger()
        if hp != self.space.default and (
            challenger is None or hp != challenger.group.hyperparameters
        ):
            claim = self._claim(hp, self._candidates(), _INTERIM_CONFIDENCE)
            return self._budget_left <= 1 and not claim.measurably_faster
        if challenger is None:
            return False
        return not self._clearly_faster(challenger)

    def _begin_legs(self, hp: Hyperparameters, other: Hyperparameters | None) -> Hyperparameters:
        """Start a close call's budget sample on ``hp``: ``close_call_time`` sampling times
        spent in legs that alternate ``hp`` and the other group of the close call (the default
        or the challenger). Each leg is measured after a switch, so each has its own share of
        the job's slow drifts, and the samples' spread, which bounds the interval however long
        one sample runs, is averaged over many legs, not over one or two samples. The first leg
        is the group that is not running: a leg of the group just measured would share that
        measurement's conditions (a lucky first sample's luck with it). Returns the first
        leg's group. ``other``: the other group, if not the default (or, for the default, the
        challenger)."""
        if other is None:
            challenger = self._challenger()
            default = self.space.default
            other = default if hp != default else None
            if other is None and challenger is not None:
                other = challenger.group.hyperparameters
        if other is None or other == hp:
            return hp
        self._legs_left = _legs_per_sample(self.config.close_call_time)
        self._legs = (hp, other)
        self._met.add(frozenset(self._legs))
        if self._group.hyperparameters == hp and self._legs_left > 1:
            self._legs = (other, hp)
        return self._legs[0]

    def _latest_group(self, hp: Hyperparameters) -> Group:
        if self._group.hyperparameters == hp:
            return self._group
        return next(r.group for r in reversed(self._records) if r.group.hyperparameters == hp)

    def _final_choice(self) -> Best:
        """The group to complete on, before the default replaces an unproven one: the best
        group (:meth:`_best_so_far`); with ``proven_fallback``, when it is not measurably
        faster than the default, the best-scored candidate that is, if any. Every
        candidate's interval allows for all of them (:meth:`_claim`), so the fallback's
        claim is as honest as the best group's would have been."""
        best = self._best
        assert best is not None
        if best.measurably_faster or not self.config.proven_fallback:
            return best
        candidates = self._candidates()
        default = self.space.default
        ranked = sorted(candidates, key=lambda hp: candidates[hp].score, reverse=True)
        claims = (self._claim(hp, candidates) for hp in ranked if hp != default)
        return next((claim for claim in claims if claim.measurably_faster), best)

    def _complete(self, train_iter: int) -> SampleRecord:
        best, default = self._final_choice(), self.space.default
        if best.group.hyperparameters != default and not best.measurably_faster:
            # The gain is within the noise: keep the default, and say how close they are.
            low, high = best.gain_interval or (0.0, 0.0)
            within = max(abs(low), abs(high))
            self._verdict = (
                f"no group measurably faster than the default: differences within ±{within:.1%}"
            )
            measured = self._measurements[default]
            score = measured.judged_score
            best = Best(self._latest_group(default), score, 0.0, within, (-within, within))
        elif best.group.hyperparameters == default:
            self._verdict = "the default group is the fastest measured"
        else:
            low, high = best.gain_interval  # type: ignore[misc]
            self._verdict = (
                f"{best.gain_vs_default:+.1%} vs the default "
                f"({self.config.gain_confidence:.0%} interval {low:+.1%} to {high:+.1%})"
            )
        hp = best.group.hyperparameters
        if self._group.hyperparameters != hp:
            self._group = Group(self._group.id + 1, hp)
        self._best = replace(best, group=self._group)
        self._state = State.COMPLETED
        self._drift_seconds = 0.0
        measured = self._measurements[hp]
        return SampleRecord(
            model=self.name,
            sample=self._spent,
            group=self._group,
            phase=Phase.COMPLETED,
            score=self._best.score,
            train_iter=train_iter,
            seconds=measured.seconds,
            iterations=measured.iterations,
            windows=measured.reports,
            gain_vs_default=self._best.gain_vs_default,
            invalid_windows=measured.invalid,
            gain_margin=self._best.gain_margin,
            note=self._verdict,
        )

    def _contenders_to_confirm(self) -> list[Hyperparameters]:
        """The best group and its runners-up within the margin, if measured only once and
        scored above every confirmed group: one below a confirmed group could not be chosen
        over it, and confirming it would take a sample from the comparison with the default
        that decides the choice."""
        ranked = sorted(self._measurements.items(), key=lambda item: item[1].score, reverse=True)
        floor = ranked[0][1].score * (1.0 - self.config.confirm_margin)
        confirmed = [m.score for m in self._measurements.values() if m.samples >= 2]
        floor = max(floor, *confirmed) if confirmed else floor
        contenders = [hp for hp, m in ranked[: self.config.confirm_top] if m.score >= floor]
        return [hp for hp in contenders if self._measurements[hp].samples < 2]

    def _next_sample(self) -> tuple[Hyperparameters, Phase] | None:
        """The next group to sample and why, or None to complete (see the module docstring)."""
        if self._optimizer is None:
            return None  # nothing to tune: the default group's score is all there is to know
        if self._legs_left and self._legs is not None:
            # The close call's budget sample goes on: its other group's leg.
            first, second = self._legs
            return (second if self._group.hyperparameters == first else first), Phase.CONFIRM
        remaining = self._budget_left
        if self._after_default and remaining > 1:
            # A reopened session looks at its earlier choice right after the default.
            return self._after_default.pop(), Phase.INITIAL
        to_confirm = self._contenders_to_confirm()
        # With confirmation on, the last sample never explores: what it found would win
        # unconfirmed. Contenders are confirmed best first, so the winner is confirmed first.
        last = 1 if self.config.confirm_top else 0
        # And the default's one sample, first after warmup, is measured again before a group
        # is chosen over it: the choice rests on the comparison of the two, so that sample
        # goes before a runner-up's confirmation (never before the best group's own).
        assert self._best is not None
        best = self._best.group.hyperparameters
        default_again = 0
        if last and best != self.space.default:
            default_again = int(self._measurements[self.space.default].samples < 2)
        last += default_again
        may_explore = remaining > max(last, len(to_confirm))
        room = remaining > default_again or (remaining > 0 and to_confirm[:1] == [best])
        if to_confirm and room and (self._converged or not may_explore):
            return to_confirm[0], Phase.CONFIRM
        if self._converged or not may_explore:
            choice = self._runner_up_first(remaining, self._default_to_confirm(remaining))
            return self._settling(remaining) if choice is None else choice
        try:
            suggestion = self._optimizer.suggest(self._sample_cost())
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

    def _runner_up_first(
        self, remaining: int, choice: tuple[Hyperparameters, Phase] | None
    ) -> tuple[Hyperparameters, Phase] | None:
        """A runner-up measured once, before completing with budget left; else ``choice``.

        A runner-up: a group measured once whose score lies within ``confirm_margin`` of the
        best score. One sample's score is good to a few percent, so one scored below a
        confirmed group, or below the default's lead, can be the best all the same; left
        unconfirmed it can never be chosen (:meth:`_candidates`). During the search such
        groups wait (:meth:`_contenders_to_confirm`): the budget goes to the comparison with
        the default first. Budget the session would leave unused is theirs; letting them go
        before a close call as well split the close calls' budget among more challengers and
        was not kept (docs/tuning_service.md, "The last sample and the runners-up")."""
        if not self.config.confirm_top or remaining <= 0:
            return choice
        default = self._measurements[self.space.default]
        if choice is not None and (default.samples < 2 or choice[1] is not Phase.CONFIRM):
            return choice  # the default's second look goes first
        top = max(m.score for m in self._measurements.values())
        floor = top * (1.0 - self.config.confirm_margin)
        ranked = sorted(self._measurements.items(), key=lambda item: item[1].score, reverse=True)
        runners = [hp for hp, m in ranked if m.samples == 1 and m.score >= floor]
        if runners and choice is None:
            return runners[0], Phase.CONFIRM
        return choice

    def _settling(self, remaining: int) -> tuple[Hyperparameters, Phase] | None:
        """With ``settle_runners_up`` and budget left, a close call between the best-scored
        confirmed group and the best-scored one within ``confirm_margin`` of it that it has
        not met in one (its partner is left in ``_partner`` for :meth:`apply`); None:
        complete. The default is left out: its comparisons are the close calls already.

        Two groups within a few percent, each confirmed in plain samples, are told apart by
        luck: the runner-up's confirming sample is the best of several such samples, and a
        close call proves a group against the default, not against its neighbours."""
        if not self.config.settle_runners_up or remaining <= 0 or not self.config.confirm_top:
            return None
        default = self.space.default
        measured = self._measurements
        confirmed = [hp for hp, m in measured.items() if m.samples >= 2 and hp != default]
        if len(confirmed) < 2:
            return None
        top, *others = sorted(confirmed, key=lambda hp: measured[hp].score, reverse=True)
        floor = measured[top].score * (1.0 - self.config.confirm_margin)
        for other in others:
            if measured[other].score < floor:
                break
            if frozenset((top, other)) not in self._met:
                self._partner = other
                return top, Phase.CONFIRM
        return None

    def _default_to_confirm(self, remaining: int) -> tuple[Hyperparameters, Phase] | None:
        """The default group again, if another group is about to be chosen over it on one
        sample of the default, or the close call between the two; None: complete.

        The default's only sample is the job's first after warmup, which can be slow for
        reasons of its own (caches, the allocator, ranks still settling), and the chosen group's
        pooled score is the best of many: set against that one sample, the gain reported to the
        user overstates the true one (docs/tuning_service.md has the figures)."""
        default = self.space.default
        if not self.config.confirm_top or remaining <= 0:
            return None
        challenger = self._challenger()
        if challenger is None:
            return None
        if self._measurements[default].samples < 2:
            return default, Phase.CONFIRM
        if not self._clearly_faster(challenger):
            # Too close to call: another close call's sample (legs of the two, the one with
            # fewer windows first unless it is running), narrowing the interval, rather than
            # complete on a gain within the noise. Before the budget is spent it ends only on
            # a gain proven at the interim level: stopping at the first sample whose interval
            # clears zero at gain_confidence would pick the luckiest of many looks, and both
            # the claim and the choice over the default would be too often wrong.
            hp = challenger.group.hyperparameters
            measured = self._measurements
            windows = {hp: len(measured[hp].confirming), default: len(measured[default].windows)}
            return min((hp, default), key=windows.__getitem__), Phase.CONFIRM
        return None

    def _sample_cost(self) -> Callable[[np.ndarray], np.ndarray] | None:
        """The cost of measuring a group that runs ``slowdown`` times slower than the best
        one, relative to a full sample: at least a full sample's time, and at least the
        iterations of a sample ended early at that group's speed: its one-iteration switch
        window, the window after it (the job learns of the end one window late) and, unless
        the switch window can end it (``hopeless_slowdown``), ``early_end_windows`` more
        (None: the optimizer's cost-aware setting is off)."""
        if not self.config.optimizer.cost_aware or self._best is None:
            return None
        best = self._measurements[self._best.group.hyperparameters]
        step = best.seconds / max(1, best.iterations)
        iterations = 2
        if not self.config.hopeless_slowdown:
            iterations += max(1, self.config.early_end_windows)
        floor = self.config.sampling_confidence_time

        def cost(slowdown: np.ndarray) -> np.ndarray:
            return np.maximum(1.0, iterations * step * slowdown / floor)

        return cost

    @property
    def _budget_left(self) -> int:
        """Samples of this round's budget not yet spent (a close call's legs make one)."""
        return self._round_budget - (self._spent - self._round_start)

    @property
    def _stop_min_groups(self) -> int:
        """Groups to measure before the search may stop early. A share of the budget as well
        as a fixed floor: on a flat landscape whose best group stands out by a few percent,
        the GP has no reason to look for it, and a long budget is what lets the search find
        it (docs/tuning_service.md has the figures)."""
        settings = self.config.optimizer
        share = math.ceil(settings.stop_min_share * self._round_budget)
        return max(settings.stop_min_groups, share)

    def _stop_searching(self) -> None:
        # A numerical failure of the optimizer must not take the job's tuning down with it:
        # the search ends and the session chooses among the groups measured so far.
        logger.exception(
            "model %s: the optimizer failed; choosing among measured groups", self.name
        )
        self._converged = True

    def _watch_drift(self, report: Report) -> None:
        """After completion: reopen when the throughput has stayed more than ``retune_drift``
        below the choice's score for ``retune_drift_time`` reported seconds in a row."""
        drift = self.config.retune_drift
        if drift is None or self._best is None or self._optimizer is None:
            return
        count = report.iterations if report.samples is None else report.samples
        if count / report.seconds < (1.0 - drift) * self._best.score:
            self._drift_seconds += report.seconds
        else:
            self._drift_seconds = 0.0
        if self._drift_seconds >= self.config.retune_drift_time:
            self._reopen()

    def _reopen(self) -> None:
        """A new round of ``retune_samples`` samples, measured afresh (what was measured before
        the drift no longer holds): the default group first, then the earlier choice, then the
        search."""
        assert self._best is not None
        chosen = self._best.group.hyperparameters
        logger.warning(
            "model %s: throughput has stayed more than %.0f%% below the chosen group's score "
            "(%.4g/s) for %.0f s; tuning again with %d samples",
            self.name,
            100 * (self.config.retune_drift or 0.0),
            self._best.score,
            self._drift_seconds,
            self.config.retune_samples,
        )
        self._retunes += 1
        self._round_start = self._spent
        self._round_budget = self.config.retune_samples
        self._measurements = {}
        self._met = set()
        self._noise_cache = None
        self._best = None
        self._converged = False
        self._verdict = None
        self._drift_seconds = 0.0
        seed = None if self.config.seed is None else self.config.seed + self._retunes
        self._optimizer = GroupOptimizer(
            self.space, self.config.optimizer, _model_seed(seed, self.name)
        )
        self._after_default = [] if chosen == self.space.default else [chosen]
        self._state = State.SAMPLING
        self._group = Group(self._group.id + 1, self.space.default)
        self._sample = _Sample(group=self._group, phase=Phase.DEFAULT)
        self._discard_next = True
        self.view = self._make_view()

    def _make_view(self) -> SessionView:
        default = self._measurements.get(self.space.default)
        return SessionView(
            name=self.name,
            state=self._state,
            current=self._group,
            samples=self._spent,
            max_samples=self._round_start + self._round_budget,
            best=self._best,
            default_score=None if default is None else default.judged_score,
            records=tuple(self._records),
            invalid_windows=self._invalid_windows,
            verdict=self._verdict,
            retunes=self._retunes,
        )


def _score(windows: list[Window]) -> float:
    return robust_throughput([w.rate for w in windows])


def _legs_per_sample(close_call_time: float) -> int:
    """Legs of a close call's budget sample: each at least one sampling time long."""
    return max(1, math.floor(close_call_time))


def _half_width(interval: tuple[float, float]) -> float:
    low, high = interval
    return (high - low) / 2.0


def _model_seed(seed: int | None, name: str) -> int | None:
    """A seed per model, so two models of one job explore independently but reproducibly."""
    if seed is None:
        return None
    return int(np.random.SeedSequence([seed, zlib.crc32(name.encode())]).generate_state(1)[0])
