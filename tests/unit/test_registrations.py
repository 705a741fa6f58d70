"""Which registration a tuning-log row belongs to: by group id, else by position."""

from distune.registrations import registration_of


def test_rows_go_to_the_latest_session_begun_at_or_below_their_group_id() -> None:
    # Two sessions; the first's choice (id 4) was logged after the second began at id 5.
    rows = [
        ("default", 1, 0),
        ("bayes", 2, 1),
        ("default", 1, 5),
        ("completed", 2, 4),
        ("initial", 2, 6),
    ]
    assert registration_of(rows) == [0, 0, 1, 0, 1]


def test_a_log_without_group_ids_splits_at_each_default_sample_one() -> None:
    rows = [("default", 1, None), ("completed", 1, None), ("default", 1, None), ("bayes", 2, None)]
    assert registration_of(rows) == [0, 0, 1, 1]
    # A log whose first row is not a session's start keeps it in the first registration.
    assert registration_of([("bayes", 3, None), ("default", 1, None)]) == [0, 1]
