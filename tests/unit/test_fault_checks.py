"""The fault benchmark's "measured twice" check reads a close call's legs as one sample."""

from __future__ import annotations

from benchmarks.faults.checks import repeated_samples


def _row(sample: int, phase: str, bucket: int) -> dict[str, str]:
    return {
        "sample": str(sample),
        "phase": phase,
        "bucket_size_2p": str(bucket),
        "is_hierarchical_reduce": "False",
    }


#: Default, two searched groups, then one close-call sample in three alternating legs.
LEGS = [
    _row(1, "default", 20),
    _row(2, "initial", 18),
    _row(3, "initial", 17),
    _row(4, "confirm", 20),
    _row(4, "confirm", 17),
    _row(4, "confirm", 20),
    _row(5, "completed", 20),
]


def test_a_close_calls_legs_are_not_samples_measured_twice():
    assert repeated_samples(LEGS) == []


def test_a_search_started_again_is_caught():
    restarted = LEGS[:3] + LEGS[:2]
    problems = repeated_samples(restarted)
    assert any("sample numbers" in p for p in problems)
    assert "the default group sampled more than once" in problems


def test_a_leg_measured_twice_in_a_row_is_caught():
    assert repeated_samples([*LEGS[:6], LEGS[5]]) == ["group 2^20 measured twice in sample 4"]


def test_a_gap_in_sample_numbers_is_caught():
    assert repeated_samples([LEGS[0], LEGS[2]]) == ["sample numbers [1, 3]"]
