"""The session state machine under any sequence of register, report and hyperparameters calls,
with any clock: hypothesis drives it and checks, after every step, that it is in a legal state.

Legal means: the state only moves forward (warmup, sampling, completed); group ids never go
back and every group handed out is in the search space; the log only grows, by whole samples,
and never holds more than ``max_samples`` of them; a refused report (stale group, mixed units)
changes nothing; once completed, the group, the best and the log never change again.
"""

import math

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from distune.space import FixedKnobs, ModelFacts
from distune.tuning_service.config import OptimizerSettings, TuningConfig
from distune.tuning_service.messages import MAX_COUNT, SECONDS_RANGE, Report, RequestError
from distune.tuning_service.session import Phase, StaleGroupError, State, TuningSession

ORDER = {State.WARMUP: 0, State.SAMPLING: 1, State.COMPLETED: 2}
TOPOLOGIES = [
    ModelFacts(world_size=8, nnodes=2, local_world_size=4, gradient_bytes=2**21),  # 12 groups
    ModelFacts(world_size=2, nnodes=1, local_world_size=2, gradient_bytes=2**18),  # 3 groups
    ModelFacts(world_size=1, nnodes=1, local_world_size=1, gradient_bytes=100),  # nothing tuned
]
# The job's clock: any window length a report may carry, with typical ones made likely.
SECONDS = st.floats(*SECONDS_RANGE) | st.sampled_from([1e-6, 0.01, 0.5, 1.0, 3.0, 1e6])
COUNTS = st.integers(1, MAX_COUNT) | st.integers(1, 1000)


class SessionMachine(RuleBasedStateMachine):
    """One session; every rule is a call a job (or a confused client) can make."""

    @initialize(
        counts_samples=st.booleans(),
        inline=st.booleans(),
        facts=st.sampled_from(TOPOLOGIES),
        fixed=st.sampled_from([FixedKnobs(), FixedKnobs(is_hierarchical_reduce=False)]),
        max_samples=st.integers(1, 6),
        warmup=st.sampled_from([0.0, 2.0]),
        confidence=st.sampled_from([0.5, 3.0]),
        min_windows=st.integers(1, 3),
        confirm_top=st.integers(0, 2),
        stall_fraction=st.sampled_from([0.0, 0.25]),
        max_windows=st.sampled_from([8, 256]),
    )
    def create(
        self,
        counts_samples,
        inline,
        facts,
        fixed,
        max_samples,
        warmup,
        confidence,
        min_windows,
        **rest,
    ):
        config = TuningConfig(
            max_samples=max_samples,
            warmup_time=warmup,
            sampling_confidence_time=confidence,
            min_windows=min_windows,
            seed=5,
            # Two initial points: the Gaussian process is fitted within a few samples.
            optimizer=OptimizerSettings(initial_points=2, stop_min_groups=2, stop_min_share=0.0),
            **rest,
        )
        self.session = TuningSession("m", facts, fixed, config)
        self.config = config
        self.counts_samples = counts_samples
        # Choose next groups inline, or leave them pending as the service's worker does.
        self.inline = inline
        self.previous = self.session.view
        self.completed_view = None

    @rule()
    def register_again(self):
        reply = self.session.register()
        assert reply == self.session.view.reply

    @rule()
    def choose_pending(self):
        """The service's worker: choose and apply the next group, if one is pending."""
        if not self.session.deciding:
            return
        before = self.session.view
        records = self.session.apply(self.session.choose_next())
        after = self.session.view
        assert after.records == before.records + tuple(records)
        assert not self.session.deciding

    @rule()
    def ask(self):
        assert self.session.view.reply.group == self.session.view.current

    @rule(
        seconds=SECONDS,
        rate=st.floats(80.0, 120.0),
        train_iter=st.integers(0, MAX_COUNT),
        windows=st.integers(1, 4),
    )
    def steady_reports(self, seconds, rate, train_iter, windows):
        """Plausible windows of the current group: any length, a rate near 100/s."""
        count = max(1, min(MAX_COUNT, round(rate * seconds)))
        seconds = min(max(count / rate, SECONDS_RANGE[0]), SECONDS_RANGE[1])
        samples = count if self.counts_samples else None
        for _ in range(windows):
            group_id = self.session.view.current.id
            self._report(Report(group_id, train_iter, count, seconds, samples))

    @rule(
        stale=st.integers(0, 3).map(lambda i: i == 0),
        other_id=st.integers(0, MAX_COUNT),
        train_iter=st.integers(0, MAX_COUNT),
        iterations=COUNTS,
        seconds=SECONDS,
        samples=st.none() | COUNTS,
    )
    def any_report(self, stale, other_id, train_iter, iterations, seconds, samples):
        """Any valid report: another group's, any counts, any clock, either unit."""
        group_id = other_id if stale else self.session.view.current.id
        try:
            report = Report(group_id, train_iter, iterations, seconds, samples)
        except RequestError as error:  # over a billion a second: refused before any session
            assert error.field in ("iterations", "samples")
            return
        self._report(report)

    def _report(self, report: Report) -> None:
        before = self.session.view
        group_id = report.group_id
        try:
            reply, records = self.session.report(report, decide=self.inline)
        except StaleGroupError as error:
            assert group_id != before.current.id
            assert error.reply == before.reply
            assert self.session.view == before  # counted, nothing else changes
            return
        except RequestError as error:
            assert error.field == "samples"  # a model is scored in one unit throughout
            assert self.session.view.records == before.records
            assert self.session.view.current == before.current
            return
        after = self.session.view
        assert reply == after.reply
        assert after.records == before.records + tuple(records)
        if records:
            assert all(r.score > 0 and math.isfinite(r.score) for r in records)

    @invariant()
    def legal(self):
        view, previous = self.session.view, self.previous
        space = self.session.space
        assert ORDER[view.state] >= ORDER[previous.state]
        assert view.current.id >= previous.current.id
        assert view.current.hyperparameters in space
        assert view.records[: len(previous.records)] == previous.records
        # A close call's legs share their budget sample's number; it counts once finished.
        numbers = [r.sample for r in view.records if r.phase is not Phase.COMPLETED]
        assert numbers == sorted(numbers)
        assert set(numbers) == set(range(1, max(numbers, default=0) + 1))
        assert view.samples <= len(set(numbers)) <= view.samples + 1
        if view.state is State.COMPLETED:
            assert view.samples == len(set(numbers))
        assert view.samples <= view.max_samples == self.config.max_samples
        assert view.invalid_windows >= previous.invalid_windows
        assert view.invalid_windows >= sum(
            r.invalid_windows for r in view.records if r.phase is not Phase.COMPLETED
        )
        if view.samples:
            assert view.best is not None and view.default_score is not None
            assert view.records[0].phase is Phase.DEFAULT
            assert view.records[0].group.hyperparameters == space.default
        # Coverage, shown by --hypothesis-show-statistics.
        event(f"reached {view.state.value}")
        event(f"{view.samples} samples")
        if self.inline:
            assert not self.session.deciding
        if view.state is State.COMPLETED:
            assert not self.session.deciding
            assert view.records[-1].phase is Phase.COMPLETED
            assert view.best.group == view.current == view.records[-1].group
            if self.completed_view is None:
                self.completed_view = view
            # A completed session never changes again: group, best, log, counts.
            assert view == self.completed_view
        else:
            assert all(r.phase is not Phase.COMPLETED for r in view.records)
        self.previous = view


SessionMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=50,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestSessionStateMachine = SessionMachine.TestCase
