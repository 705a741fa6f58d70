"""The tuning session's state machine, driven by scripted reports (no clock, no sleeping)."""

import math
import random

import pytest

from distune.space import FixedKnobs, Hyperparameters, ModelFacts
from distune.tuning_service.config import OptimizerSettings, TuningConfig
from distune.tuning_service.messages import Report, RequestError
from distune.tuning_service.optimizer import GroupOptimizer
from distune.tuning_service.session import Phase, StaleGroupError, State, TuningSession

TWO_NODES = ModelFacts(world_size=8, nnodes=2, local_world_size=4, gradient_bytes=2**28)
ONE_NODE = ModelFacts(world_size=4, nnodes=1, local_world_size=4, gradient_bytes=2**28)
FAST = TuningConfig(
    max_samples=12, sampling_confidence_time=3.0, min_windows=3, warmup_time=2.0, seed=7
)


def session(config: TuningConfig = FAST, facts=TWO_NODES, fixed=None, name="m"):
    return TuningSession(name, facts, fixed or FixedKnobs(), config)


def window(s: TuningSession, rate: float, seconds: float = 1.0, train_iter: int = 0):
    """One report window of the current group at ``rate`` iterations per second."""
    iterations = max(1, round(rate * seconds))
    return s.report(Report(s.view.current.id, train_iter, iterations, iterations / rate))


def peaked(hp: Hyperparameters) -> float:
    """Throughput peaking at bucket 2^24, flat; hierarchical 10% slower."""
    shape = 1000.0 * math.exp(-(((hp.bucket_size_2p - 24) / 3.0) ** 2)) + 200.0
    return shape * (0.9 if hp.is_hierarchical_reduce else 1.0)


def run_to_completion(s: TuningSession, landscape=peaked, noise=0.0, seed=0, limit=10_000):
    """Report ~1 s windows of the current group until the session completes; the log rows."""
    rng = random.Random(seed)
    records = []
    for step in range(limit):
        if s.view.state is State.COMPLETED:
            return records
        rate = landscape(s.view.current.hyperparameters) * math.exp(rng.gauss(0.0, noise))
        records += window(s, rate, train_iter=step)[1]
    raise AssertionError("the session did not complete")


def test_default_group_is_handed_out_first_and_sampled_first():
    s = session()
    reply = s.view.reply
    assert reply.group.id == 0
    assert reply.group.hyperparameters == Hyperparameters(25, False)
    assert reply.state is State.WARMUP
    records = run_to_completion(s)
    assert records[0].sample == 1
    assert records[0].phase is Phase.DEFAULT
    assert records[0].group.hyperparameters == Hyperparameters(25, False)
    assert records[0].gain_vs_default == 0.0


def test_warmup_ends_after_its_reported_seconds_then_default_is_scored():
    s = session()
    assert window(s, 100.0, seconds=1.5)[0].state is State.WARMUP
    assert window(s, 100.0, seconds=0.4)[0].state is State.WARMUP  # 1.9 s < 2.0 s
    reply, records = window(s, 100.0, seconds=0.2)
    assert reply.state is State.SAMPLING and not records
    # Warmup windows are never scored: three 1 s windows at 50/s make the default's score.
    for _ in range(2):
        assert window(s, 50.0)[1] == []
    reply, records = window(s, 50.0)
    assert [r.sample for r in records] == [1]
    assert records[0].score == pytest.approx(50.0)
    assert records[0].windows == 3 and records[0].seconds == pytest.approx(3.0)
    assert reply.group.id == 1 and reply.state is State.SAMPLING
    assert s.view.default_score == pytest.approx(50.0)


def test_a_sample_needs_both_its_time_and_its_windows():
    s = session(TuningConfig(sampling_confidence_time=2.0, min_windows=3, warmup_time=0, seed=1))
    window(s, 10.0)  # discarded: first window after registration
    assert window(s, 10.0, seconds=5.0)[1] == []  # time reached, one window
    assert window(s, 10.0)[1] == []  # two windows
    assert len(window(s, 10.0)[1]) == 1


def test_first_window_after_a_switch_is_discarded():
    # A steady 80 against 100 would end early, and so would a switch window this slow without
    # a switch cost measured before it (see the early-end tests): measured in full here.
    config = TuningConfig(
        sampling_confidence_time=3.0,
        warmup_time=0,
        seed=1,
        early_end_windows=0,
        hopeless_slowdown=0,
    )
    s = session(config)
    for _ in range(4):
        window(s, 100.0)
    assert s.view.samples == 1 and s.view.current.id == 1
    window(s, 1.0)  # the switch's cost: discarded, or the next score would be ruined
    for _ in range(2):
        window(s, 80.0)
    records = window(s, 80.0)[1]
    assert records[0].score == pytest.approx(80.0)
    assert records[0].windows == 3


def test_robust_score_ignores_an_outlier_window():
    s = session(TuningConfig(sampling_confidence_time=5.0, warmup_time=0, seed=1))
    window(s, 100.0)  # discarded
    rates = [100.0, 101.0, 5000.0, 99.0, 100.0]  # one absurdly lucky window
    records = []
    for rate in rates:
        records += window(s, rate)[1]
    assert records[0].score == pytest.approx(100.0, rel=0.01)  # the mean would be 1080


def test_a_stalled_window_is_set_aside_and_the_sample_measured_on():
    s = session(TuningConfig(sampling_confidence_time=3.0, warmup_time=0, seed=1))
    window(s, 100.0)
    for rate in (100.0, 2.0, 100.0):  # a data-loader stall in the middle
        assert window(s, rate)[1] == []  # the stall's second does not count towards the 3 s
    records = window(s, 100.0)[1]
    assert records[0].score == pytest.approx(100.0)
    assert records[0].windows == 3 and records[0].invalid_windows == 1
    assert records[0].seconds == pytest.approx(3.0)
    assert s.view.invalid_windows == 1


def test_stale_group_report_is_refused_with_the_current_group_and_counted():
    s = session()
    with pytest.raises(StaleGroupError) as info:
        s.report(Report(group_id=5, train_iter=1, iterations=10, seconds=1.0))
    assert info.value.reply.group.id == 0
    assert "group_id" in str(info.value)
    assert s.stale_reports == 1
    for _ in range(6):
        window(s, 100.0)
    assert s.view.current.id == 1
    with pytest.raises(StaleGroupError):
        s.report(Report(group_id=0, train_iter=1, iterations=10, seconds=1.0))
    assert s.stale_reports == 2


def test_completes_within_max_samples_and_never_changes_group_afterwards():
    s = session(TuningConfig(max_samples=6, sampling_confidence_time=3.0, warmup_time=0, seed=3))
    records = run_to_completion(s)
    # Samples of the budget: a close call's legs are rows of one sample.
    samples = {r.sample for r in records if r.phase is not Phase.COMPLETED}
    assert 1 <= len(samples) <= 6
    assert records[-1].phase is Phase.COMPLETED
    final = s.view
    assert final.state is State.COMPLETED and final.samples == len(samples)
    assert final.best is not None and final.best.group == final.current
    for _ in range(50):
        reply, rows = window(s, random.uniform(1.0, 1e6))
        assert reply.group == final.current and reply.completed and rows == []
    assert s.register().group == final.current


def test_all_three_states_in_order():
    s = session()
    seen = [s.view.state]
    while s.view.state is not State.COMPLETED:
        window(s, peaked(s.view.current.hyperparameters))
        if s.view.state is not seen[-1]:
            seen.append(s.view.state)
    assert seen == [State.WARMUP, State.SAMPLING, State.COMPLETED]


def test_nothing_to_tune_completes_on_the_default_after_measuring_it():
    fixed = FixedKnobs(bucket_size_2p=22)
    s = session(facts=ONE_NODE, fixed=fixed)
    assert s.space.tuned == ()
    records = run_to_completion(s)
    assert [r.phase for r in records] == [Phase.DEFAULT, Phase.COMPLETED]
    assert s.view.best.group.hyperparameters == Hyperparameters(22, False)
    assert s.view.best.gain_vs_default == 0.0
    assert s.view.default_score == pytest.approx(peaked(Hyperparameters(22, False)))


@pytest.mark.parametrize(
    ("fixed", "tuned", "check"),
    [
        (
            FixedKnobs(is_hierarchical_reduce=True),
            ("bucket_size_2p",),
            lambda hp: hp.is_hierarchical_reduce is True,
        ),
        (
            FixedKnobs(bucket_size_2p=20),
            ("is_hierarchical_reduce",),
            lambda hp: hp.bucket_size_2p == 20,
        ),
    ],
)
def test_fixed_knobs_are_absent_from_the_search(fixed, tuned, check):
    s = session(fixed=fixed)
    assert s.space.tuned == tuned
    records = run_to_completion(s)
    assert all(check(r.group.hyperparameters) for r in records)
    assert check(s.view.current.hyperparameters)


def test_single_node_never_tries_hierarchical():
    s = session(facts=ONE_NODE)
    records = run_to_completion(s)
    assert not any(r.group.hyperparameters.is_hierarchical_reduce for r in records)


def test_finds_the_peak_of_a_noisy_landscape():
    s = session(TuningConfig(max_samples=20, sampling_confidence_time=5.0, warmup_time=0, seed=11))
    run_to_completion(s, noise=0.03, seed=11)
    chosen = s.view.best.group.hyperparameters
    assert peaked(chosen) >= 0.98 * peaked(Hyperparameters(24, False))
    assert s.view.best.gain_vs_default > 0.0


def test_no_group_is_measured_more_than_twice_and_a_small_space_stops_early():
    # Only the allreduce shape is tuned: two groups. Measuring each twice is all there is.
    s = session(TuningConfig(max_samples=20, warmup_time=0, seed=2), fixed=FixedKnobs(22))
    records = [r for r in run_to_completion(s, noise=0.02) if r.phase is not Phase.COMPLETED]
    counts: dict[Hyperparameters, int] = {}
    for r in records:
        counts[r.group.hyperparameters] = counts.get(r.group.hyperparameters, 0) + 1
    assert set(counts) == {Hyperparameters(22, False), Hyperparameters(22, True)}
    assert max(counts.values()) <= 2
    assert len(records) < 20


def test_the_chosen_group_was_measured_at_least_twice():
    s = session(TuningConfig(max_samples=15, warmup_time=0, seed=5))
    records = run_to_completion(s, noise=0.03, seed=5)
    chosen = s.view.best.group.hyperparameters
    assert sum(r.group.hyperparameters == chosen for r in records[:-1]) >= 2


def test_a_lucky_sample_does_not_win_without_confirmation():
    """The fifth sampled group (the first the GP picks) measures 8% above the true peak the
    first time (a quiet network, say): it is re-measured before it can be chosen, and loses
    once its samples are pooled."""
    peak = peaked(Hyperparameters(24, False))
    # One sample 8% off makes the samples' own spread large: a low confidence keeps the +9%
    # of the peak over the default measurable, so what is tested is the confirmation.
    s = session(TuningConfig(max_samples=20, warmup_time=0, seed=5, gain_confidence=0.5))
    while s.view.state is not State.COMPLETED:
        hp = s.view.current.hyperparameters
        window(s, 1.08 * peak if s.view.samples == 4 else peaked(hp))
    lucky = s.view.records[4]
    assert lucky.score == pytest.approx(1.08 * peak)
    assert peaked(lucky.group.hyperparameters) < 0.9 * peak
    confirmations = [
        r for r in s.view.records[5:] if r.group.hyperparameters == lucky.group.hyperparameters
    ]
    assert confirmations and confirmations[0].phase is Phase.CONFIRM
    assert peaked(s.view.best.group.hyperparameters) >= 0.98 * peak


def test_reregistration_resumes_and_discards_the_next_window():
    s = session(TuningConfig(sampling_confidence_time=3.0, warmup_time=0, seed=1))
    for _ in range(3):
        window(s, 100.0)  # one discarded, two scored
    reply = s.register()
    assert reply.group.id == 0 and reply.state is State.SAMPLING
    window(s, 1.0)  # discarded: the restart's cost
    records = window(s, 100.0)[1]
    assert records[0].score == pytest.approx(100.0) and records[0].windows == 3


def test_samples_must_be_given_in_every_report_or_none():
    s = session(TuningConfig(warmup_time=0, seed=1))
    s.report(Report(0, 1, 10, 1.0, samples=320))
    s.report(Report(0, 2, 10, 1.0, samples=320))  # scored in samples per second
    with pytest.raises(RequestError) as info:
        s.report(Report(0, 3, 10, 1.0))
    assert info.value.field == "samples"


def test_samples_make_the_score_samples_per_second():
    s = session(TuningConfig(sampling_confidence_time=3.0, warmup_time=0, seed=1))
    records = []
    for step in range(4):
        records += s.report(Report(0, step, 10, 1.0, samples=320))[1]
    assert records[0].score == pytest.approx(320.0)


def test_a_seed_makes_a_session_reproducible():
    settings = OptimizerSettings(initial_design="lhs")
    config = TuningConfig(max_samples=8, warmup_time=0, seed=4, optimizer=settings)
    runs = [run_to_completion(session(config), noise=0.03) for _ in range(2)]
    assert [r.group for r in runs[0]] == [r.group for r in runs[1]]


def test_an_optimizer_failure_ends_the_search_on_the_best_measured_group(monkeypatch):
    def broken(self):
        raise FloatingPointError("injected: the GP fit diverged")

    monkeypatch.setattr(GroupOptimizer, "suggest", broken)
    s = session(TuningConfig(max_samples=10, warmup_time=0, seed=1))
    records = run_to_completion(s)
    assert s.view.state is State.COMPLETED
    assert s.view.best.group.hyperparameters == Hyperparameters(25, False)
    assert [r.phase for r in records] == [Phase.DEFAULT, Phase.CONFIRM, Phase.COMPLETED]


def test_a_group_measured_once_cannot_win_over_a_confirmed_one_when_the_budget_runs_out():
    """Scripted by sample: the 2nd group measures high by luck and is confirmed with the
    budget's last sample but one; it comes down, and the 3rd and 4th groups, measured once
    (also by luck), now have higher scores. The last sample measures the default again, not a
    runner-up: the choice rests on the comparison with it. The choice is the best confirmed
    group."""
    measured = [100.0, 130.0, 128.0, 122.0, 110.0, 100.0]  # the rate of sample 1, 2, ...
    # Samples this far apart for one group make a wide interval on the gain: a low confidence
    # keeps +10% measurable, so the choice shown is the confirmed group's, not the default's.
    # Confirmations as long as other samples, so the pooled scores below weigh them alike.
    config = TuningConfig(
        max_samples=6,
        sampling_confidence_time=3.0,
        warmup_time=0,
        seed=3,
        gain_confidence=0.5,
        close_call_time=1.0,
    )
    s = session(config)
    while s.view.state is not State.COMPLETED:
        window(s, measured[s.view.samples])
    *samples, final = s.view.records
    default, a, b, lucky = (samples[i].group.hyperparameters for i in range(4))
    assert [r.phase for r in samples[4:]] == [Phase.CONFIRM, Phase.CONFIRM]
    assert [r.group.hyperparameters for r in samples[4:]] == [a, default]
    # Pooled, a scores 120 (trimmed mean of 130, 130, 110, 110): below b's and the lucky
    # group's single 128 and 122, which the best score alone would choose.
    assert samples[2].score == pytest.approx(128.0) and samples[3].score == pytest.approx(122.0)
    assert final.group.hyperparameters == a not in (b, lucky)
    assert s.view.best.group == s.view.current == final.group
    # Its score and gain are its confirming sample's, which chose nothing: 110, +10%.
    assert final.score == pytest.approx(110.0)
    assert final.gain_vs_default == pytest.approx(0.1)


@pytest.mark.parametrize("share, groups", [(0.0, 8), (0.5, 10)])
def test_the_search_stops_early_only_after_a_share_of_the_budget(share, groups):
    """On a smooth landscape the search converges early, but never before ``stop_min_groups``
    (8) groups, nor before half of the 20-sample budget's worth of groups with
    ``stop_min_share`` 0.5 (the cost-aware acquisition may look at a group more first).
    Over the whole range, as written: bounded by ``max_buckets_2p`` to 2^20..2^28 around the
    peak, the search measures 11 groups before its expected improvement falls below the
    threshold, which says nothing about the floor."""
    settings = OptimizerSettings(stop_min_share=share, max_buckets_2p=None)
    s = session(TuningConfig(max_samples=20, warmup_time=0, seed=2, optimizer=settings))
    samples = [
        r for r in run_to_completion(s, noise=0.02, seed=2) if r.phase is not Phase.COMPLETED
    ]
    assert groups <= len({r.group.hyperparameters for r in samples}) <= groups + 1
    assert len(samples) < 20


def broad_top(hp: Hyperparameters) -> float:
    """Throughput with a broad peak at 2^22: 2^21 and 2^23 within 0.6%, the default's 2^25 5%
    below (a gain a close call proves); hierarchical 10% slower."""
    shape = 1000.0 * math.exp(-(((hp.bucket_size_2p - 22) / 12.0) ** 2)) + 200.0
    return shape * (0.9 if hp.is_hierarchical_reduce else 1.0)


def _lucky_second_looks(settle: bool, seed: int) -> TuningSession:
    """A session on ``broad_top`` with 3% window noise, in which every group's second sample
    reads 5% high (the best of several runners-up's second looks is high by luck)."""
    config = TuningConfig(
        max_samples=20, warmup_time=0, seed=seed, proven_fallback=True, settle_runners_up=settle
    )
    s = session(config)
    rng = random.Random(seed)
    for step in range(50_000):
        if s.view.state is State.COMPLETED:
            return s
        hp = s.view.current.hyperparameters
        earlier = [r for r in s.view.records if r.group.hyperparameters == hp]
        second_look = len(earlier) == 1 and earlier[0].phase is not Phase.DEFAULT
        lucky = 1.05 if second_look else 1.0
        window(s, broad_top(hp) * lucky * math.exp(rng.gauss(0.0, 0.03)), train_iter=step)
    raise AssertionError("the session did not complete")


def _close_calls(s: TuningSession) -> list[set[Hyperparameters]]:
    """The pairs of groups whose legs made one sample of the budget."""
    per_sample: dict[int, list[Hyperparameters]] = {}
    for r in s.view.records:
        if r.phase is not Phase.COMPLETED:
            per_sample.setdefault(r.sample, []).append(r.group.hyperparameters)
    return [set(hps) for hps in per_sample.values() if len(hps) > 2]


def test_near_equal_confirmed_groups_meet_in_a_close_call_before_one_is_chosen():
    """A runner-up confirmed in one plain sample that read high beat the peak a close call
    proved against the default in four seeds of four; with ``settle_runners_up`` the two meet
    in a close call with the budget left, and the peak is chosen in every seed."""
    peak = Hyperparameters(22, False)
    seeds = range(2, 6)
    unsettled = [_lucky_second_looks(False, seed) for seed in seeds]
    assert all(s.view.best.group.hyperparameters != peak for s in unsettled)
    for s in unsettled:
        assert all(s.space.default in pair for pair in _close_calls(s))
    for seed in seeds:
        s = _lucky_second_looks(True, seed)
        pairs = [pair for pair in _close_calls(s) if s.space.default not in pair]
        assert pairs and s.view.samples <= 20
        assert s.view.best.group.hyperparameters == peak
        assert s.view.best.measurably_faster


def _samples_of(s: TuningSession, hp: Hyperparameters) -> list:
    return [
        r
        for r in s.view.records
        if r.phase is not Phase.COMPLETED and r.group.hyperparameters == hp
    ]


def far_peak(hp: Hyperparameters) -> float:
    """Throughput peaking at bucket 2^20, far from the default's 2^25; hierarchical slower."""
    return peaked(Hyperparameters(hp.bucket_size_2p + 4, hp.is_hierarchical_reduce))


def test_the_default_is_measured_again_before_another_group_is_chosen():
    """The default's first sample is the job's first after warmup, here 30% slow (start-up).
    Before the session completes on the peak it measures the default again, and the gain it
    reports sets the peak against that later sample, not against the slow first one (which
    is also what the peak was chosen over)."""
    default = Hyperparameters(25, False)
    s = session(TuningConfig(max_samples=20, sampling_confidence_time=3.0, warmup_time=0, seed=2))
    while s.view.state is not State.COMPLETED:
        hp = s.view.current.hyperparameters
        window(s, 0.7 * far_peak(hp) if s.view.samples == 0 else far_peak(hp))
    first, again = _samples_of(s, default)
    assert first.phase is Phase.DEFAULT and first.score == pytest.approx(0.7 * far_peak(default))
    assert again.phase is Phase.CONFIRM and again.score == pytest.approx(far_peak(default))
    assert again.sample == s.view.records[-2].sample  # the last sample before completing
    chosen = s.view.best.group.hyperparameters
    assert far_peak(chosen) >= 0.98 * far_peak(Hyperparameters(20, False))
    assert s.view.default_score == pytest.approx(far_peak(default))
    gain = s.view.best.gain_vs_default
    assert gain == pytest.approx(s.view.best.score / s.view.default_score - 1)
    assert gain < s.view.best.score / first.score - 1  # what it would have claimed
    assert s.view.records[-1].gain_vs_default == gain


def test_a_default_unlucky_the_first_time_wins_on_its_second_look():
    """The default is truly the fastest (100/s, every other group 90/s) but its first sample
    reads 85/s: the search moves on and confirms another group, then the default's second
    sample lifts its pooled score above the others' and the session keeps the default after
    all. (Its two samples disagree by 16%, so the runner-up's interval still reaches above
    zero, and the budget left goes to the two: the default's lead only grows.)"""
    default = Hyperparameters(25, False)
    s = session(TuningConfig(max_samples=20, sampling_confidence_time=3.0, warmup_time=0, seed=2))
    while s.view.state is not State.COMPLETED:
        hp = s.view.current.hyperparameters
        window(s, (85.0 if s.view.samples == 0 else 100.0) if hp == default else 90.0)
    phases = [r.phase for r in _samples_of(s, default)]
    assert phases[:2] == [Phase.DEFAULT, Phase.CONFIRM] and set(phases[2:]) <= {Phase.CONFIRM}
    assert s.view.best.group.hyperparameters == default == s.view.current.hyperparameters
    assert 92.5 <= s.view.best.score <= 100.0
    assert s.view.best.gain_vs_default == 0.0


@pytest.mark.parametrize(
    "config",
    [
        TuningConfig(
            max_samples=20, sampling_confidence_time=3.0, warmup_time=0, seed=2, confirm_top=0
        ),
        # Three samples: the default, one group, its confirmation; none left for the default.
        TuningConfig(max_samples=3, sampling_confidence_time=3.0, warmup_time=0, seed=2),
    ],
    ids=["without confirmation", "budget spent"],
)
def test_the_default_is_not_measured_again_without_confirmation_or_budget(config):
    s = session(config)
    run_to_completion(s, landscape=far_peak)
    assert s.view.best.group.hyperparameters != Hyperparameters(25, False)
    assert len(_samples_of(s, Hyperparameters(25, False))) == 1


def test_the_default_is_measured_again_before_a_group_is_chosen_over_it():
    """Five samples: the search stops a sample early so that the default's first sample,
    taken right after warmup, is not the only evidence the choice rests on."""
    config = TuningConfig(max_samples=5, sampling_confidence_time=3.0, warmup_time=0, seed=2)
    s = session(config)
    run_to_completion(s, landscape=far_peak)
    assert s.view.best.group.hyperparameters != Hyperparameters(25, False)
    phases = [r.phase for r in _samples_of(s, Hyperparameters(25, False))]
    assert phases == [Phase.DEFAULT, Phase.CONFIRM]
