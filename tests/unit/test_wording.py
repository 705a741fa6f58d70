"""How distune words counts for people: "1 node", never "1 nodes"."""

import pytest

from distune.wording import counted, describe_registration


@pytest.mark.parametrize(
    ("number", "noun", "plural", "words"),
    [
        (1, "node", None, "1 node"),
        (2, "node", None, "2 nodes"),
        (0, "sample", None, "0 samples"),
        (1, "registration", None, "1 registration"),
        (1, "process", "processes", "1 process"),
        (3, "process", "processes", "3 processes"),
        (None, "sample", None, "None samples"),  # a malformed answer: not known to be one
        (True, "model", None, "True models"),
    ],
)
def test_counted_takes_the_singular_only_for_one(number, noun, plural, words):
    assert counted(number, noun, plural) == words


def test_a_one_rank_registration_reads_in_the_singular():
    registration = {"world_size": 1, "nnodes": 1, "local_world_size": 1, "gradient_bytes": 4}
    assert describe_registration(registration) == "1 rank (1 node x 1), 4 gradient bytes"
