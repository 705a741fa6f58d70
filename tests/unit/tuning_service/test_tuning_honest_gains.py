"""Cheap exploration and honest gains, driven by scripted reports: a hopeless sample ends
early, the gain's interval covers the true gain, the session keeps the default when no group
is measurably faster, and it reopens when the throughput drifts after completion."""

import math
import random

import pytest

from distune.space import FixedKnobs, Hyperparameters, ModelFacts
from distune.tuning_service.config import ConfigError, TuningConfig
from distune.tuning_service.messages import Report
from distune.tuning_service.session import Phase, State, TuningSession, _score

# Two groups: the bucket is fixed; flat (the default) or hierarchical.
TWO_GROUPS = ModelFacts(world_size=4, nnodes=2, local_world_size=2, gradient_bytes=2**24)
FIXED_BUCKET = FixedKnobs(bucket_size_2p=22)
FLAT, HIERARCHICAL = Hyperparameters(22, False), Hyperparameters(22, True)


def session(facts=TWO_GROUPS, fixed=FIXED_BUCKET, **overrides) -> TuningSession:
    values = dict(max_samples=4, sampling_confidence_time=5.0, warmup_time=0.0, seed=3)
    return TuningSession("m", facts, fixed, TuningConfig(**{**values, **overrides}))


def send(s: TuningSession, rate: float, seconds: float = 1.0):
    """One window of the current group at ``rate`` iterations/s, about ``seconds`` long."""
    iterations = max(1, round(rate * seconds))
    return s.report(Report(s.view.current.id, 0, iterations, iterations / rate))


def run(s: TuningSession, true_rate, rng: random.Random, sigma: float) -> None:
    """Report windows with log-normal noise ``sigma`` around ``true_rate(hp)`` until the
    session completes."""
    while s.view.state is not State.COMPLETED:
        rate = true_rate(s.view.current.hyperparameters) * math.exp(rng.gauss(0.0, sigma))
        send(s, rate)


def swinging(s: TuningSession, level, seconds: float = 1.0) -> None:
    """Report windows at ``level(hp, budget samples so far)`` times a repeating ±4 % swing
    until the session completes."""
    swing = [1.0, 1.04, 0.96]
    count = 0
    while s.view.state is not State.COMPLETED:
        hp = s.view.current.hyperparameters
        send(s, level(hp, s.view.samples) * swing[count % 3], seconds)
        count += 1


def measured(s: TuningSession) -> list:
    """The log rows of samples and legs (not the final choice)."""
    return [r for r in s.view.records if r.phase is not Phase.COMPLETED]


class TestEarlyEnd:
    def test_a_hopeless_sample_ends_after_two_windows_and_is_scored_with_them(self):
        # A 2^16..2^24 bucket range: the design explores; every group but the default is
        # hopeless, 20 iterations/s against 100.
        s = session(fixed=FixedKnobs(), max_samples=3, confirm_top=0)
        for _ in range(6):
            send(s, 100.0)  # the default: the switch window, then 5 s
        assert s.view.samples == 1 and s.view.current.hyperparameters != FLAT
        send(s, 50.0)  # the switch's window: not hopeless on its own, discarded
        assert send(s, 20.0)[1] == []  # one window is not enough to judge
        (record,) = send(s, 21.0)[1]
        assert record.phase is Phase.INITIAL and record.ended_early
        assert record.windows == 2 and record.score == pytest.approx(20.5)
        assert record.seconds < 5.0  # less than a full sample's time
        assert s.view.samples == 2

    def test_one_stalled_window_does_not_end_a_good_sample(self):
        s = session(fixed=FixedKnobs(), max_samples=3, confirm_top=0)
        for _ in range(6):
            send(s, 100.0)
        send(s, 5.0)
        send(s, 30.0)  # a stall
        assert send(s, 101.0)[1] == []  # the fastest window is not clearly slower: go on
        records = []
        for _ in range(4):
            records += send(s, 101.0)[1]
        assert not records[0].ended_early and records[0].windows >= 3

    def test_the_default_and_confirmations_are_never_ended_early(self):
        s = session(max_samples=4, early_end_windows=2)
        for _ in range(6):
            send(s, 100.0)
        send(s, 1.0)
        for _ in range(5):
            send(s, 150.0)  # hierarchical: much faster, now the best
        # The default is measured again before completing on another group: even at half its
        # first speed it is measured in full, so the gain over it is a real measurement.
        send(s, 1.0)
        records = []
        while not records:
            records = send(s, 50.0)[1]
        assert records[0].phase is Phase.CONFIRM and not records[0].ended_early

    def test_early_end_can_be_switched_off(self):
        s = session(
            fixed=FixedKnobs(),
            max_samples=3,
            confirm_top=0,
            early_end_windows=0,
            hopeless_slowdown=0,
        )
        for _ in range(6):
            send(s, 100.0)
        send(s, 5.0)
        assert s.view.samples == 1  # not ended at its switch window either
        assert send(s, 20.0)[1] == [] and send(s, 20.0)[1] == []  # measured in full


class TestHopelessSwitchWindow:
    """The worker's window after a switch lasts one iteration: a group that is hopeless even
    allowing for what a switch costs ends right there."""

    @staticmethod
    def default_sample(s: TuningSession, startup: float) -> None:
        """The default group at 100 iterations/s; its first window carries ``startup``."""
        s.report(Report(s.view.current.id, 0, 100, 1.0 + startup))
        for _ in range(5):
            send(s, 100.0)
        assert s.view.samples == 1

    @staticmethod
    def one_iteration(s: TuningSession, seconds: float):
        return s.report(Report(s.view.current.id, 0, 1, seconds))

    def test_a_hopeless_sample_ends_at_its_switch_window_scored_with_it(self):
        s = session(fixed=FixedKnobs(), max_samples=3, confirm_top=0)
        self.default_sample(s, startup=0.2)
        explored = s.view.current
        # One iteration in 12 s, against 0.01 s at the best group's speed: even less twice
        # the 0.2 s a start (or switch) costs, it is far beyond hopeless_slowdown (4x).
        (record,) = self.one_iteration(s, 12.0)[1]
        assert record.group == explored and record.phase is Phase.INITIAL
        assert record.ended_early and record.windows == 1 and record.iterations == 1
        assert record.score == pytest.approx(1 / 12)
        assert s.view.samples == 2 and s.view.current != explored

    def test_a_noisy_good_sample_with_a_dear_switch_is_measured_in_full(self):
        s = session(fixed=FixedKnobs(), max_samples=3, confirm_top=0)
        self.default_sample(s, startup=0.2)
        explored = s.view.current
        # 26x slower than 100/s, but all of it within twice the switch cost measured so far.
        assert self.one_iteration(s, 0.26)[1] == []
        records = []
        for rate in (92.0, 108.0, 95.0, 105.0, 99.0):  # +-8%: noise, not a slower group
            assert records == []
            records += send(s, rate)[1]
        (record,) = records
        assert record.group == explored and not record.ended_early and record.windows == 5
        assert record.score == pytest.approx(99.67, abs=0.01)

    def test_measured_switches_replace_the_start_up_as_the_allowance(self):
        s = session(fixed=FixedKnobs(), max_samples=4, confirm_top=0)
        self.default_sample(s, startup=5.0)  # a slow start: 5 s
        assert self.one_iteration(s, 0.3)[1] == []  # a switch that costs 0.29 s
        for _ in range(5):
            send(s, 100.0)
        assert s.view.samples == 2
        # 3 s for one iteration: within twice the start-up's 5 s, but far beyond the switch's.
        (record,) = self.one_iteration(s, 3.0)[1]
        assert record.ended_early and record.windows == 1

    def test_the_default_and_confirmations_are_never_ended_at_the_switch(self):
        s = session(max_samples=4)
        self.default_sample(s, startup=0.0)
        assert self.one_iteration(s, 0.01)[1] == []
        for _ in range(5):
            send(s, 150.0)  # hierarchical, now the best
        assert s.view.samples == 2
        assert self.one_iteration(s, 10.0)[1] == []  # the default again: a confirmation
        assert s.view.samples == 2

    def test_the_switch_window_judgement_can_be_switched_off(self):
        s = session(fixed=FixedKnobs(), max_samples=3, confirm_top=0, hopeless_slowdown=0)
        self.default_sample(s, startup=0.2)
        assert self.one_iteration(s, 12.0)[1] == []
        assert s.view.samples == 1

    @pytest.mark.parametrize("value", [0.5, -1, True, "4"])
    def test_a_slowdown_below_one_is_refused(self, value):
        with pytest.raises(ConfigError, match="hopeless_slowdown must be 0 \\(off\\) or"):
            TuningConfig(hopeless_slowdown=value)


class TestHonestGain:
    @staticmethod
    def simulate(
        gain: float, offset: float, max_samples: int, runs: int, rng: random.Random
    ) -> tuple[float, float]:
        """Seeded sessions where hierarchical is truly ``gain`` faster than flat, windows carry
        4.5 % noise and each sample its own ``offset``: the share of runs whose interval holds
        the true gain, and the share that chose hierarchical."""
        truth = {FLAT: 100.0, HIERARCHICAL: 100.0 * (1.0 + gain)}
        covered, faster = 0, 0
        for seed in range(runs):
            s = session(max_samples=max_samples, seed=seed)
            offsets: dict[int, float] = {}

            def rate(hp, s=s, offsets=offsets):
                group = s.view.current.id
                offsets.setdefault(group, math.exp(rng.gauss(0.0, offset)))
                return truth[hp] * offsets[group]

            run(s, rate, rng, 0.045)
            best = s.view.best
            true_gain = truth[best.group.hyperparameters] / truth[FLAT] - 1.0
            low, high = best.gain_interval
            covered += low <= true_gain <= high
            faster += best.group.hyperparameters == HIERARCHICAL
        return covered / runs, faster / runs

    def test_the_interval_covers_the_true_gain_in_at_least_90_percent_of_runs(self):
        """Seeded simulation: hierarchical is truly 6% faster; windows carry 4.5% noise and
        each sample its own 1% offset. The 95% interval must hold +6% in >= 90% of runs."""
        covered, _ = self.simulate(0.06, 0.01, max_samples=6, runs=200, rng=random.Random(14))
        assert covered >= 0.90

    @pytest.mark.parametrize(
        ("offset", "coverage", "chosen"), [(0.01, 0.90, 0.95), (0.03, 0.90, 0.95)]
    )
    def test_coverage_when_the_spread_rests_on_few_degrees_of_freedom(
        self, offset, coverage, chosen
    ):
        """Seeded simulation at the budget of 8: hierarchical truly 5 % faster, 4.5 % window
        noise, each sample (each leg of a close call) its own offset. With the benchmark's 1 %
        offsets, and with offsets three times the spread's prior guess, the 95 % interval
        holds +5 % in >= 90 % of runs and the session proves the gain and keeps hierarchical
        in >= 95 %. With one long sample of each group in place of legs the samples' offsets
        bounded the interval: at 3 % hierarchical was kept in 72 % of these 150 runs."""
        covered, faster = self.simulate(
            0.05, offset, max_samples=8, runs=150, rng=random.Random(15)
        )
        assert covered >= coverage and faster >= chosen

    def test_one_lucky_default_sample_does_not_hide_a_clear_gain(self):
        """Hierarchical is 10 % faster; the default's first sample reads 6 % high. Its two
        samples are the only pair measured, one degree of freedom: unregularised, their spread
        made the interval about ±18 % and kept the default. With the prior (and Student's t
        for the degrees of freedom it rests on) the gain is measurable."""
        s = session(max_samples=4)
        swing = [1.0, 1.04, 0.96]
        count = 0
        while s.view.state is not State.COMPLETED:
            if s.view.current.hyperparameters == HIERARCHICAL:
                level = 110.0
            else:
                level = 106.0 if s.view.samples == 0 else 100.0
            send(s, level * swing[count % 3])
            count += 1
        best = s.view.best
        assert best.group.hyperparameters == HIERARCHICAL and best.measurably_faster
        assert best.gain_vs_default == pytest.approx(0.09, abs=0.01)
        assert best.gain_margin < 0.10

    def test_nothing_measurably_faster_completes_on_the_default_and_says_so(self):
        rng = random.Random(6)
        s = session(max_samples=6, close_call_time=5.0)
        # Hierarchical 0.5% faster: within the noise of the windows six samples (close calls
        # of five sampling times) hold.
        run(s, lambda hp: 100.5 if hp.is_hierarchical_reduce else 100.0, rng, 0.04)
        assert s.view.state is State.COMPLETED
        assert s.view.current.hyperparameters == FLAT
        best = s.view.best
        assert best.group.hyperparameters == FLAT and best.gain_vs_default == 0.0
        assert not best.measurably_faster
        assert s.view.verdict.startswith(
            "no group measurably faster than the default: differences within ±"
        )
        within = float(s.view.verdict.rsplit("±", 1)[1].rstrip("%")) / 100
        assert 0.0 < within < 0.2 and best.gain_margin == pytest.approx(within, abs=1e-3)
        final = s.view.records[-1]
        assert final.phase is Phase.COMPLETED and final.note == s.view.verdict
        status = s.view.to_status()
        assert status["verdict"] == s.view.verdict
        assert status["best"]["measurably_faster"] is False

    def test_windows_merged_past_max_windows_count_as_the_reports_they_hold(self):
        """A long close call's windows are merged in pairs past ``max_windows``; a merged
        window averages its reports, so its noise is one report's over their count. Sessions
        fed the same windows, one merging them into at most 16 and one keeping all, report
        about the same interval. When a merged window counted as one report, its low noise
        also read as the job's: these intervals came out 1.5 to 2.3 times wider merged."""
        ratios = []
        for seed in range(4):
            margins = []
            for max_windows in (16, 4096):
                s = session(max_samples=6, close_call_time=10.0, max_windows=max_windows)
                streams = {hp: random.Random(f"{hp}{seed}") for hp in (FLAT, HIERARCHICAL)}
                while s.view.state is not State.COMPLETED:
                    hp = s.view.current.hyperparameters
                    level = 100.5 if hp == HIERARCHICAL else 100.0
                    send(s, level * math.exp(streams[hp].gauss(0.0, 0.045)))
                margins.append(s.view.best.gain_margin)
            merged, kept = margins
            ratios.append(merged / kept)
        assert 0.75 <= sum(ratios) / len(ratios) <= 1.25

    def test_a_clearly_faster_group_is_chosen_with_its_interval(self):
        rng = random.Random(6)
        s = session(max_samples=6)
        run(s, lambda hp: 130.0 if hp.is_hierarchical_reduce else 100.0, rng, 0.04)
        best = s.view.best
        assert best.group.hyperparameters == HIERARCHICAL and best.measurably_faster
        low, high = best.gain_interval
        assert 0.0 < low < 0.30 < high
        assert s.view.verdict.startswith(f"{best.gain_vs_default:+.1%} vs the default (95%")

    def test_a_close_call_spends_leftover_budget_on_the_two_groups(self):
        """Hierarchical leads by 2% in windows that swing by ±4%: too close to call in close
        calls of five sampling times, so the rest of the budget re-measures the two (narrowing
        the interval) and the session still completes on the default."""
        s = session(max_samples=8, close_call_time=5.0)
        swinging(s, lambda hp, _: 102.0 if hp.is_hierarchical_reduce else 100.0)
        rows = measured(s)
        assert s.view.samples == 8 and rows[-1].sample == 8  # the whole budget went into it
        assert {r.phase for r in rows[2:]} == {Phase.CONFIRM}
        assert s.view.current.hyperparameters == FLAT
        assert s.view.verdict.startswith("no group measurably faster than the default")

    def test_a_close_call_sample_alternates_the_two_groups_in_legs(self):
        """A close call's sample of the budget runs close_call_time sampling times as legs
        of one sampling time each, alternating the challenger and the default, each leg a
        switch (a fresh group id, its first window discarded): each has its own share of the
        job's slow drifts, so the samples' spread is averaged over many legs. The first leg is
        the group not running, and the legs count as one sample of the budget."""
        s = session(max_samples=4, close_call_time=3.0)
        swinging(s, lambda hp, _: 102.0 if hp.is_hierarchical_reduce else 100.0)
        rows = measured(s)
        assert [r.sample for r in rows] == [1, 2, 3, 3, 3, 4, 4, 4]
        groups = [r.group.hyperparameters for r in rows]
        assert groups == [FLAT, HIERARCHICAL] * 4  # never the same group twice in a row
        assert len({r.group.id for r in rows}) == len(rows)
        assert all(5.0 <= r.seconds < 6.0 for r in rows)
        assert s.view.samples == s.view.max_samples == 4

    def test_the_gain_is_claimed_from_the_confirming_samples_alone(self):
        """Hierarchical's first sample reads 106 (the luck that made it the best) and the
        default's 98 (the bad luck that made the other look better), their later legs 103 and
        100: the claim is +3%, from the legs after each group's first sample only."""
        s = session(max_samples=3, close_call_time=3.0)

        def level(hp, _):
            later = len(s.view.records) >= 2
            if hp == HIERARCHICAL:
                return 103.0 if later else 106.0
            return 100.0 if later else 98.0

        swinging(s, level)
        first, lucky, default, confirming, again = measured(s)
        assert [r.group.hyperparameters for r in (first, lucky, default, confirming, again)] == [
            FLAT,
            HIERARCHICAL,
            FLAT,
            HIERARCHICAL,
            FLAT,
        ]
        assert default.score == again.score == pytest.approx(s.view.default_score)
        claim = s._claim(HIERARCHICAL, s._candidates())
        assert claim.score == pytest.approx(confirming.score)
        assert claim.gain_vs_default == pytest.approx(0.03)  # 103 against 100
        assert confirming.gain_vs_default == pytest.approx(0.03)
        assert lucky.score / first.score - 1 > 0.06  # what the first samples would claim

    def test_a_close_call_ends_before_the_budget_only_on_a_clear_gain(self):
        """Hierarchical is 4% faster, but the default's first sample reads 4% high. The close
        call looks at the interval after each sample of the budget; before the last it ends
        only on a gain proven at the interim level (Haybittle-Peto's 99.9 %): a gain proven at
        95 % there is the luckiest of several looks as often as not, so it goes on. Once the
        gain is clear it ends, with budget left."""
        s = session(max_samples=10)
        proven_at = []  # budget samples after which the 95 % interval lay above zero

        def level(hp, samples):
            best = s.view.best
            if best is not None and best.measurably_faster and samples not in proven_at:
                proven_at.append(samples)
            return 104.0 if hp.is_hierarchical_reduce or samples == 0 else 100.0

        swinging(s, level)
        best = s.view.best
        assert best.group.hyperparameters == HIERARCHICAL and best.measurably_faster
        assert proven_at[0] < s.view.samples < 10  # went on after a 95 % proof, then ended
        assert best.gain_interval[0] < 0.04 < best.gain_interval[1]

    def test_a_close_call_also_runs_while_the_default_leads_by_luck(self):
        """Hierarchical is 5% faster, but its one sample reads 101 and the default's first
        106: the default leads, and hierarchical, below it, is not confirmed. With budget
        left the session does not complete on that lead: it measures the two against each
        other, and proves the gain."""
        s = session(max_samples=10)

        def level(hp, samples):
            if hp == HIERARCHICAL:
                return 101.0 if samples == 1 else 105.0
            return 106.0 if samples == 0 else 100.0

        swinging(s, level)
        rows = measured(s)
        assert [r.group.hyperparameters for r in rows[:3]] == [FLAT, HIERARCHICAL, FLAT]
        assert rows[1].score < 102.0 < rows[0].score
        assert {r.phase for r in rows[2:]} == {Phase.CONFIRM}
        best = s.view.best
        assert best.group.hyperparameters == HIERARCHICAL and best.measurably_faster

    def test_a_default_clearly_ahead_completes_without_a_close_call(self):
        s = session(max_samples=10)
        swing = [1.0, 1.04, 0.96]
        count = 0
        while s.view.state is not State.COMPLETED:
            level = 80.0 if s.view.current.hyperparameters == HIERARCHICAL else 100.0
            send(s, level * swing[count % 3])
            count += 1
        assert s.view.samples < 10 and s.view.current.hyperparameters == FLAT
        assert s.view.verdict == "the default group is the fastest measured"

    def test_a_close_call_of_slow_iterations_runs_longer_in_windows_too(self):
        """Iterations of 10 s: a sample's three windows outlast the sampling time five times
        over, so a close call three times as long in seconds alone would be no longer at
        all; its sample of the budget runs close_call_time times the windows too, as legs."""
        s = session(max_samples=4, close_call_time=3.0)
        swinging(s, lambda hp, _: 0.102 if hp.is_hierarchical_reduce else 0.1, seconds=10.0)
        rows = measured(s)
        assert [r.windows for r in rows[:2]] == [3, 3]  # default, hierarchical: plain
        for sample in (3, 4):  # the close call's samples of the budget: 9 windows in legs
            legs = [r for r in rows if r.sample == sample]
            assert {r.phase for r in legs} == {Phase.CONFIRM}
            assert [r.windows for r in legs] == [3, 3, 3]

    def test_a_close_call_re_measures_the_default_longer_a_clear_gain_does_not(self):
        swing = [1.0, 1.04, 0.96]

        def samples_3_4(level: float) -> list[tuple[int, bool, bool]]:
            s = session(max_samples=4, close_call_time=2.0)
            count = 0
            while s.view.state is not State.COMPLETED:
                hierarchical = s.view.current.hyperparameters.is_hierarchical_reduce
                send(s, (level if hierarchical else 100.0) * swing[count % 3])
                count += 1
            rows = [r for r in measured(s) if r.sample in (3, 4)]
            return [(r.sample, r.group.hyperparameters == FLAT, r.seconds < 6.0) for r in rows]

        # Within the windows' swing: each sample of the budget a close call, two legs (of one
        # sampling time each) of the two groups, the one not running first.
        legs = [(3, True, True), (3, False, True), (4, True, True), (4, False, True)]
        assert samples_3_4(102.0) == legs
        # Clearly faster: hierarchical confirmed, then the default's second look, plain.
        assert samples_3_4(150.0) == [(3, False, True), (4, True, True)]


class TestDrift:
    def tuned(self, **overrides) -> TuningSession:
        s = session(max_samples=4, retune_drift_time=10.0, retune_samples=3, **overrides)
        rng = random.Random(1)
        run(s, lambda hp: 150.0 if hp.is_hierarchical_reduce else 100.0, rng, 0.02)
        assert s.view.current.hyperparameters == HIERARCHICAL
        return s

    def test_a_lasting_drop_reopens_with_a_small_budget_default_first(self):
        s = self.tuned(retune_drift=0.2)
        samples_before = s.view.samples
        for _ in range(9):
            send(s, 90.0)  # 40% below the choice's score, for 9 s: not yet
        assert s.view.state is State.COMPLETED
        send(s, 90.0)  # the 10th second
        view = s.view
        assert view.state is State.SAMPLING and view.retunes == 1
        assert view.current.hyperparameters == FLAT  # the default first, then the old choice
        assert view.max_samples == samples_before + 3
        assert view.to_status()["retunes"] == 1
        rng = random.Random(2)
        # Conditions changed: now flat is the faster one.
        run(s, lambda hp: 60.0 if hp.is_hierarchical_reduce else 95.0, rng, 0.02)
        round_two = [r for r in s.view.records[samples_before + 1 :]]
        phases = [r.phase for r in round_two]
        assert phases[:2] == [Phase.DEFAULT, Phase.INITIAL] and phases[-1] is Phase.COMPLETED
        assert round_two[1].group.hyperparameters == HIERARCHICAL  # the earlier choice
        assert s.view.current.hyperparameters == FLAT
        assert s.view.samples == samples_before + 3

    def test_a_short_dip_or_drift_off_keeps_the_choice(self):
        s = self.tuned(retune_drift=0.2)
        for _ in range(3):
            for _ in range(8):
                send(s, 90.0)
            send(s, 150.0)  # back up: the count starts again
        assert s.view.state is State.COMPLETED and s.view.retunes == 0
        off = self.tuned()  # retune_drift None: off by default
        for _ in range(100):
            send(off, 50.0)
        assert off.view.state is State.COMPLETED and off.view.retunes == 0

    @pytest.mark.parametrize("value", [0.0, 1.5, -0.1])
    def test_a_drift_fraction_outside_0_1_is_refused_by_name(self, value):
        with pytest.raises(ConfigError, match=r"retune_drift must be in \(0, 1\]"):
            TuningConfig(retune_drift=value)


# A bucket range to search, flat only; the default is 2^24 B (25 MiB rounded, the range's top).
FLAT_RANGE = FixedKnobs(is_hierarchical_reduce=False)


def by_role(s: TuningSession, levels: dict) -> list:
    """Report windows with a repeating ±4 % swing until the session completes: the default
    group at ``levels["default"](n)``, the i-th other group the session measures at
    ``levels[i](n)`` (n: that group's samples so far, a close call's legs included), any
    other at 60 (ended early). Returns the other groups in the order first measured."""
    swing = [1.0, 1.04, 0.96]
    roles: list = []
    samples: dict = {}
    count, last_id = 0, None
    while s.view.state is not State.COMPLETED:
        group = s.view.current
        hp = group.hyperparameters
        if group.id != last_id:
            samples[hp] = samples.get(hp, -1) + 1
            last_id = group.id
        if hp == s.space.default:
            level = levels["default"]
        else:
            if hp not in roles:
                roles.append(hp)
            level = levels.get(roles.index(hp), lambda n: 60.0)
        send(s, level(samples[hp]) * swing[count % 3])
        count += 1
    return roles


class TestRunnersUp:
    def test_a_runner_up_measured_once_is_confirmed_before_completing_with_budget_left(self):
        """Group A (5 % faster) is proven at the interim level; runner-up B read 104.8 on its
        one sample, below A's confirmed 105, but is truly 10 % faster. Before, the session
        completed on A with budget left (B, measured once, could never be chosen); now that
        budget confirms B, which is then chosen."""
        s = session(fixed=FLAT_RANGE, max_samples=8)
        a, b = by_role(
            s,
            {
                "default": lambda n: 100.0,
                0: lambda n: 105.0,
                1: lambda n: 104.8 if n == 0 else 110.0,
            },
        )[:2]
        assert s._measurements[a].samples > 2  # A's close call, in legs
        assert b in {r.group.hyperparameters for r in measured(s) if r.sample == 8}
        best = s.view.best
        assert best.group.hyperparameters == b and best.measurably_faster

    def test_the_budgets_last_sample_confirms_an_unproven_contender_in_legs(self):
        """Budget 8: the close call of sample 7 measures A (first read 104.5, truly 103)
        against the default; the last sample confirms contender B (first read 104, truly 6 %
        faster). A plain sample of B (a few windows) could never prove its gain, and an
        unproven group is not chosen over the default: so that sample is a close call of B
        against the default, in legs, which proves it."""
        s = session(fixed=FLAT_RANGE, max_samples=8)
        b = by_role(
            s,
            {
                "default": lambda n: 100.0,
                0: lambda n: 104.5 if n == 0 else 103.0,
                1: lambda n: 104.0 if n == 0 else 106.0,
            },
        )[1]
        last = [r.group.hyperparameters for r in measured(s) if r.sample == 8]
        assert last == [b, s.space.default] * (len(last) // 2) and len(last) > 2
        best = s.view.best
        assert best.group.hyperparameters == b and best.measurably_faster
        assert best.gain_interval[0] < 0.06 < best.gain_interval[1]


class TestNoiseCache:
    def test_the_cached_noise_and_scores_equal_a_fresh_computation_at_every_window(self):
        """The window noise, the samples' spread and each group's scores are computed once
        after each change of the measurements (a finished sample, a reopening), not at every
        window and claim. Through a seeded session with a search, close calls in legs, a
        completion and a reopening on drift, they equal a computation from scratch after
        every report."""
        rng = random.Random(11)
        s = session(
            fixed=FixedKnobs(),
            max_samples=8,
            close_call_time=3.0,
            retune_drift=0.2,
            retune_drift_time=5.0,
            retune_samples=3,
        )

        def rate(hp):
            return 100.0 * (1.02 if hp.is_hierarchical_reduce else 1.0) - abs(
                hp.bucket_size_2p - 20
            )

        checked = 0
        while s.view.retunes == 0 or s.view.state is not State.COMPLETED:
            slow = 0.5 if s.view.state is State.COMPLETED else 1.0  # drifts once completed
            send(s, slow * rate(s.view.current.hyperparameters) * math.exp(rng.gauss(0.0, 0.045)))
            cached = s._noise()
            window = s._pooled_window_sigma()
            assert (cached.window, cached.sample, cached.freedom) == (
                window,
                *s._sample_sigma(window),
            )
            for group in s._measurements.values():
                assert group.score == _score(group.windows)
                assert group.judged_score == _score(group.judged()[0])
            checked += bool(s._measurements)
        samples = [r.sample for r in measured(s)]
        assert s.view.retunes == 1 and checked > 100
        assert len(set(samples)) < len(samples)  # a close call's legs share their sample
