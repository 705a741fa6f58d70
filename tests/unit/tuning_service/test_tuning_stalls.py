"""Windows whose step times jump: slow first steps and checkpoint pauses are trimmed, stalls of
several windows' worth are set aside (not scored, counted), long samples stay bounded."""

import pytest

from distune.space import FixedKnobs, Hyperparameters, ModelFacts
from distune.tuning_service.config import ConfigError, TuningConfig
from distune.tuning_service.messages import Report
from distune.tuning_service.score import Window, bounded, split_stalls
from distune.tuning_service.session import State, TuningSession
from distune.tuning_service.tuning_log import COLUMNS, render

# Two groups only: the bucket is fixed, flat (the default) or hierarchical.
TWO_GROUPS = ModelFacts(world_size=4, nnodes=2, local_world_size=2, gradient_bytes=2**24)
FIXED_BUCKET = FixedKnobs(bucket_size_2p=22)


def config(**overrides) -> TuningConfig:
    values = dict(
        max_samples=4,
        sampling_confidence_time=5.0,
        min_windows=3,
        warmup_time=0.0,
        confirm_top=0,
        seed=3,
    )
    return TuningConfig(**{**values, **overrides})


def two_group_session(**overrides) -> TuningSession:
    return TuningSession("m", TWO_GROUPS, FIXED_BUCKET, config(**overrides))


def send(s: TuningSession, rate: float, seconds: float = 1.0, train_iter: int = 0):
    """One window of the current group: ``rate`` iterations/s over ``seconds``."""
    iterations = max(1, round(rate * seconds))
    return s.report(Report(s.view.current.id, train_iter, iterations, iterations / rate))


def stall(s: TuningSession, rate: float, work: float, pause: float):
    """A window of ``work`` seconds of steps at ``rate`` plus a ``pause`` with no step."""
    iterations = max(1, round(rate * work))
    return s.report(Report(s.view.current.id, 0, iterations, iterations / rate + pause))


def measure(s: TuningSession, windows) -> list:
    """Discard the switch window, then send ``windows`` (callables); the records produced."""
    send(s, 1.0)  # the first window after a switch is never scored
    records = []
    for w in windows:
        records += w(s)[1]
    return records


class TestStallRule:
    def test_a_window_below_a_quarter_of_the_median_is_stalled(self):
        windows = [Window(100, 100, 1.0), Window(100, 100, 1.0), Window(24, 24, 1.0)]
        valid, stalled = split_stalls(windows, [], 0.25)
        assert valid == windows[:2] and stalled == windows[2:]

    def test_slow_but_not_stalled_windows_are_kept(self):
        windows = [Window(100, 100, 1.0), Window(100, 100, 1.0), Window(30, 30, 1.0)]
        assert split_stalls(windows, [], 0.25) == (windows, [])

    def test_the_groups_earlier_windows_are_the_reference(self):
        # One window alone is its own median; the group's earlier windows expose it.
        window = Window(10, 10, 1.0)
        assert split_stalls([window], [], 0.25) == ([window], [])
        assert split_stalls([window], [100.0, 100.0], 0.25) == ([], [window])

    def test_fraction_zero_keeps_everything(self):
        windows = [Window(100, 100, 1.0), Window(1, 1, 100.0)]
        assert split_stalls(windows, [], 0.0) == (windows, [])

    def test_stall_fraction_is_validated(self):
        with pytest.raises(ConfigError, match="stall_fraction"):
            config(stall_fraction=1.0)
        with pytest.raises(ConfigError, match="max_windows"):
            config(max_windows=2)


class TestSession:
    def test_a_slow_first_step_is_trimmed_not_set_aside(self):
        s = two_group_session()
        # A slow first scored window (compilation, cold caches): a third of the speed.
        records = measure(s, [lambda s: send(s, 33.0)] + [lambda s: send(s, 100.0)] * 4)
        assert records[0].score == pytest.approx(100.0)
        assert records[0].invalid_windows == 0 and records[0].windows == 5

    def test_a_checkpoint_pause_in_one_window_is_set_aside(self):
        s = two_group_session()
        pause = [lambda s: stall(s, 100.0, work=1.0, pause=30.0)]  # 30 s checkpoint
        steady = [lambda s: send(s, 100.0)]
        records = measure(s, steady * 2 + pause + steady * 2)
        assert records == []  # the pause's 31 s do not count towards the sample's 5 s
        records = send(s, 100.0)[1]
        assert records[0].score == pytest.approx(100.0)
        assert records[0].seconds == pytest.approx(5.0)
        assert records[0].windows == 5 and records[0].invalid_windows == 1

    def test_a_stall_over_two_windows_does_not_make_the_faster_group_lose(self):
        s = two_group_session()
        default = s.view.current.hyperparameters
        assert default == Hyperparameters(22, False)
        measure(s, [lambda s: send(s, 100.0)] * 5)  # the default: 100/s
        assert s.view.current.hyperparameters == Hyperparameters(22, True)
        # Hierarchical is 10% faster, but a data-loader stall hits two of its five windows:
        # trimming alone would keep one of them and score it near 77/s, a loss.
        fast = [lambda s: send(s, 110.0)]
        stalled = [lambda s: stall(s, 110.0, work=1.0, pause=8.0)]
        records = measure(s, fast * 2 + stalled * 2 + fast * 3)
        sample, final = records
        assert sample.invalid_windows == 2 and sample.score == pytest.approx(110.0)
        assert s.view.state is State.COMPLETED
        assert final.group.hyperparameters == Hyperparameters(22, True)
        assert final.gain_vs_default == pytest.approx(0.1)
        assert s.view.invalid_windows == 2
        assert s.view.to_status()["invalid_windows"] == 2

    def test_an_honestly_slow_group_keeps_all_its_windows(self):
        s = two_group_session(early_end_windows=0)  # measured in full, not ended early
        measure(s, [lambda s: send(s, 100.0)] * 5)
        # Five times slower than the default, steadily: a slow group, not a stall.
        records = measure(s, [lambda s: send(s, 20.0)] * 5)
        sample, final = records
        assert sample.score == pytest.approx(20.0)
        assert sample.invalid_windows == 0 and sample.windows == 5
        assert final.group.hyperparameters == Hyperparameters(22, False)
        assert s.view.invalid_windows == 0

    def test_invalid_windows_are_a_csv_column(self):
        s = two_group_session()
        measure(s, [lambda s: send(s, 100.0)] * 2 + [lambda s: stall(s, 100.0, 1.0, 9.0)])
        for _ in range(3):
            send(s, 100.0)
        header, *rows = [line.split(",") for line in render(s.view.records).splitlines()]
        column = COLUMNS.index("invalid_windows")
        assert tuple(header) == COLUMNS
        assert [row[column] for row in rows][:1] == ["1"]


class TestBoundedWindows:
    def test_merging_keeps_every_iteration_and_second(self):
        windows = [Window(i + 1, i + 1, 0.5 + i) for i in range(9)]
        merged = bounded(windows, 4)
        assert len(merged) <= 4
        assert sum(w.count for w in merged) == sum(w.count for w in windows)
        assert sum(w.seconds for w in merged) == pytest.approx(sum(w.seconds for w in windows))
        assert sum(w.reports for w in merged) == 9

    def test_a_long_sample_keeps_at_most_max_windows_and_counts_all_its_time(self):
        s = two_group_session(sampling_confidence_time=100.0, max_windows=16)
        send(s, 1.0)
        records = []
        for _ in range(799):
            records += send(s, 80.0, seconds=0.125)[1]
            assert len(s._sample.windows) <= 16
        assert records == []  # 99.875 s < 100 s
        records = send(s, 80.0, seconds=0.125)[1]
        assert records[0].windows == 800
        assert records[0].seconds == pytest.approx(100.0)
        assert records[0].score == pytest.approx(80.0)
