"""The sync-point collective's encoding, and how far apart sync points fall."""

import time

import pytest
import torch
import torch.distributed as dist

from distune import Hyperparameters
from distune.worker_runtime.meter import Window, WindowMeter
from distune.worker_runtime.sync import (
    MAX_GROWTH,
    SWITCH_WINDOW,
    Agreement,
    Decision,
    WindowSchedule,
    decode,
    encode,
    exchange,
    iterations_to_next,
)

DECISION = Decision(group_id=7, hyperparameters=Hyperparameters(21, True), iterations_to_next=40)


def reduce_max(*contributions: list[float]) -> list[float]:
    """What all_reduce(MAX) does to the ranks' contributions."""
    return [max(values) for values in zip(*contributions, strict=True)]


def test_the_maximum_carries_the_slowest_seconds_and_the_leaders_decision():
    leader = encode(0.8, DECISION)
    others = [encode(1.3, None), encode(0.9, None)]
    assert decode(reduce_max(leader, *others)) == Agreement(1.3, DECISION)


@pytest.mark.parametrize(
    "decision",
    [
        Decision(None, Hyperparameters(16, False), 1),
        Decision(0, Hyperparameters(0, False), 5, completed=True),
        Decision(2**40, Hyperparameters(48, True), 10**6),
    ],
)
def test_every_decision_survives_the_round_trip(decision):
    assert decode(reduce_max(encode(0.5, decision), encode(0.1, None))).decision == decision


def test_no_leader_is_an_error_not_a_silent_default():
    with pytest.raises(RuntimeError, match="no rank contributed a decision"):
        decode(reduce_max(encode(1.0, None), encode(2.0, None)))


@pytest.mark.parametrize(
    ("seconds", "iterations", "interval", "expected"),
    [
        (0.5, 10, 1.0, 20),  # 50 ms steps: 20 iterations a second
        (2.0, 10, 1.0, 5),  # slower: fewer
        (0.01, 10, 1.0, 10 * MAX_GROWTH),  # a fast window grows the next one at most 4x
        (5.0, 1, 1.0, 1),  # never fewer than one
        (0.0, 3, 1.0, 3),  # no usable time: keep the window
        (float("nan"), 3, 1.0, 3),
    ],
)
def test_windows_aim_at_the_sync_interval(seconds, iterations, interval, expected):
    assert iterations_to_next(seconds, iterations, interval) == expected


def test_a_ceiling_lets_a_window_grow_back_past_fourfold():
    assert iterations_to_next(0.01, 1, 1.0, ceiling=50) == 50
    assert iterations_to_next(0.01, 1, 1.0, ceiling=2) == MAX_GROWTH


class TestWindowSchedule:
    def test_a_switch_is_one_iteration_then_sized_from_it_up_to_the_window_before(self):
        schedule = WindowSchedule(1.0)
        assert schedule.next(Window(200, 1.0), switching=True) == SWITCH_WINDOW
        # The new group: 0.02 s for its first iteration (the switch's cost included).
        assert schedule.next(Window(1, 0.02), switching=False) == 50
        # Never longer than the window before the switch, however fast the first one read.
        schedule.next(Window(40, 1.0), switching=True)
        assert schedule.next(Window(1, 0.001), switching=False) == 40

    def test_a_hopeless_group_costs_one_iteration_a_window(self):
        schedule = WindowSchedule(1.0)
        schedule.next(Window(1000, 1.0), switching=True)
        assert schedule.next(Window(1, 12.0), switching=False) == 1
        assert schedule.next(Window(1, 12.0), switching=False) == 1

    def test_switches_in_a_row_keep_the_earlier_ceiling_then_it_is_spent(self):
        schedule = WindowSchedule(1.0)
        schedule.next(Window(100, 1.0), switching=True)
        schedule.next(Window(1, 5.0), switching=True)  # ended at its switch window
        assert schedule.next(Window(1, 0.001), switching=False) == 100
        # From then on windows grow at most fourfold again.
        assert schedule.next(Window(100, 0.01), switching=False) == 100 * MAX_GROWTH


def test_decisions_need_at_least_one_iteration():
    with pytest.raises(ValueError, match="iterations_to_next"):
        Decision(1, Hyperparameters(), 0)


def test_exchange_on_a_world_of_one_returns_own_values():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        agreement = exchange(dist.group.WORLD, torch.device("cpu"), 0.25, DECISION)
    finally:
        dist.destroy_process_group()
    assert agreement == Agreement(0.25, DECISION)


def test_meter_counts_iterations_and_seconds():
    meter = WindowMeter(torch.device("cpu"))
    with pytest.raises(RuntimeError, match="no window"):
        meter.stop(3)
    meter.start(10)
    time.sleep(0.02)
    window = meter.stop(14)
    assert window.iterations == 4
    assert 0.02 <= window.seconds < 1.0
    assert not meter.started
