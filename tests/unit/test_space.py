"""The search space and hyperparameter groups shared by service and runtime."""

import subprocess
import sys

import pytest

from distune.space import (
    DEFAULT_BUCKET_SIZE_2P,
    FixedKnobs,
    HyperparameterError,
    Hyperparameters,
    ModelFacts,
    SearchSpace,
    bucket_size_2p_for,
)

MULTI_NODE = ModelFacts(world_size=8, nnodes=2, local_world_size=4, gradient_bytes=100 * 2**20)
SINGLE_NODE = ModelFacts(world_size=4, nnodes=1, local_world_size=4, gradient_bytes=100 * 2**20)


def test_default_group_is_torch_ddp_bucket_rounded_and_flat():
    hp = Hyperparameters()
    assert hp == Hyperparameters(25, False)
    assert DEFAULT_BUCKET_SIZE_2P == 25
    assert hp.bucket_size == 2**25


def test_round_trip_through_dict():
    hp = Hyperparameters(bucket_size_2p=22, is_hierarchical_reduce=True)
    assert hp.to_dict() == {"bucket_size_2p": 22, "is_hierarchical_reduce": True}
    assert Hyperparameters.from_dict(hp.to_dict()) == hp


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"bucket_size_2p": 22}, "missing hyperparameter(s) is_hierarchical_reduce"),
        (
            {"bucket_size_2p": 22, "is_hierarchical_reduce": False, "x": 1},
            "unknown hyperparameter(s) 'x'",
        ),
        (
            {"bucket_size_2p": 22.0, "is_hierarchical_reduce": False},
            "bucket_size_2p must be an integer",
        ),
        (
            {"bucket_size_2p": True, "is_hierarchical_reduce": False},
            "bucket_size_2p must be an integer",
        ),
        (
            {"bucket_size_2p": 49, "is_hierarchical_reduce": False},
            "bucket_size_2p must be in [0, 48]",
        ),
        (
            {"bucket_size_2p": 22, "is_hierarchical_reduce": "no"},
            "is_hierarchical_reduce must be a boolean",
        ),
        ([22, False], "hyperparameters must be an object"),
    ],
)
def test_from_dict_rejects_bad_input_naming_the_field(data, message):
    with pytest.raises(HyperparameterError) as info:
        Hyperparameters.from_dict(data)
    assert message in str(info.value)


def test_numpy_like_integers_are_normalised():
    numpy = pytest.importorskip("numpy")
    hp = Hyperparameters(numpy.int64(20), False)
    assert type(hp.bucket_size_2p) is int
    assert hash(hp) == hash(Hyperparameters(20, False))


@pytest.mark.parametrize(
    ("nbytes", "exponent"),
    [(1, 0), (3 * 2**20, 22), (25 * 2**20, 25), (2**16, 16), (5 * 2**19, 21)],
)
def test_bucket_size_in_bytes_rounds_to_nearest_power_of_two(nbytes, exponent):
    assert bucket_size_2p_for(nbytes) == exponent


@pytest.mark.parametrize("nbytes", [0, -5, 1.5, True])
def test_bucket_size_in_bytes_must_be_positive_whole(nbytes):
    with pytest.raises(HyperparameterError, match="bucket size must be"):
        bucket_size_2p_for(nbytes)


def test_bucket_size_in_bytes_is_at_most_2_48_as_at_every_entry_point():
    assert bucket_size_2p_for(2**48) == 48
    with pytest.raises(
        HyperparameterError, match=r"at most 2\*\*48 bytes \(256 TiB\), got 281474976710657"
    ):
        bucket_size_2p_for(2**48 + 1)  # rounded to 2**48 before: the launcher refuses it


def test_space_spans_64k_to_model_size_and_both_shapes_on_multi_node():
    space = SearchSpace.for_model(MULTI_NODE)
    assert (space.min_bucket_size_2p, space.max_bucket_size_2p) == (16, 27)  # 100 MiB -> 2**27
    assert space.tuned == ("bucket_size_2p", "is_hierarchical_reduce")
    assert space.hierarchical_choices == (False, True)
    assert space.size == 12 * 2
    assert len(set(space)) == space.size
    assert space.default == Hyperparameters(25, False)


@pytest.mark.parametrize(
    "facts",
    [SINGLE_NODE, ModelFacts(world_size=2, nnodes=2, local_world_size=1, gradient_bytes=2**20)],
)
def test_hierarchical_is_not_offered_where_it_equals_flat(facts):
    space = SearchSpace.for_model(facts, FixedKnobs(is_hierarchical_reduce=True))
    assert space.hierarchical_choices == (False,)
    assert space.tuned == ("bucket_size_2p",)
    assert all(not hp.is_hierarchical_reduce for hp in space)


def test_small_model_clamps_default_to_one_bucket():
    facts = ModelFacts(world_size=2, nnodes=1, local_world_size=2, gradient_bytes=3 * 2**20)
    space = SearchSpace.for_model(facts)
    assert space.max_bucket_size_2p == 22
    assert space.default == Hyperparameters(22, False)


def test_tiny_model_has_nothing_to_tune():
    facts = ModelFacts(world_size=2, nnodes=1, local_world_size=2, gradient_bytes=1000)
    space = SearchSpace.for_model(facts)
    assert space.tuned == ()
    assert list(space) == [Hyperparameters(16, False)]
    assert space.complete([]) == space.default


def test_fixed_knobs_are_removed_from_the_search():
    space = SearchSpace.for_model(MULTI_NODE, FixedKnobs(bucket_size_2p=20))
    assert space.tuned == ("is_hierarchical_reduce",)
    assert space.complete([True]) == Hyperparameters(20, True)
    assert space.default == Hyperparameters(20, False)
    space = SearchSpace.for_model(MULTI_NODE, FixedKnobs(is_hierarchical_reduce=True))
    assert space.tuned == ("bucket_size_2p",)
    assert space.default == Hyperparameters(25, True)
    assert space.complete([18]) == Hyperparameters(18, True)


def test_default_bucket_size_is_configurable():
    space = SearchSpace.for_model(MULTI_NODE, default_bucket_size=4 * 2**20)
    assert space.default == Hyperparameters(22, False)


def test_point_and_complete_are_inverse_and_accept_numpy_values():
    numpy = pytest.importorskip("numpy")
    space = SearchSpace.for_model(MULTI_NODE)
    hp = Hyperparameters(19, True)
    assert space.point(hp) == [19, True]
    assert space.complete([numpy.int64(19), numpy.bool_(True)]) == hp
    with pytest.raises(HyperparameterError, match="outside the search space"):
        space.complete([30, False])
    with pytest.raises(HyperparameterError, match="outside the search space"):
        space.point(Hyperparameters(40, False))


@pytest.mark.parametrize(
    ("assignments", "expected"),
    [
        (["bucket_size_2p=22"], FixedKnobs(bucket_size_2p=22)),
        (["is_hierarchical_reduce=false"], FixedKnobs(is_hierarchical_reduce=False)),
        (["is_hierarchical_reduce=True", "bucket_size_2p=18"], FixedKnobs(18, True)),
        ([], FixedKnobs()),
    ],
)
def test_fixed_knobs_parse_command_line_assignments(assignments, expected):
    assert FixedKnobs.parse(assignments) == expected


@pytest.mark.parametrize(
    ("assignments", "message"),
    [
        (["bucket_size_2p"], "expected NAME=VALUE"),
        (["bucket=3"], "unknown hyperparameter(s) 'bucket'; allowed: bucket_size_2p"),
        (["bucket_size_2p=big"], "bucket_size_2p must be an integer"),
        (["is_hierarchical_reduce=maybe"], "is_hierarchical_reduce must be true or false"),
    ],
)
def test_fixed_knobs_parse_errors_name_the_problem(assignments, message):
    with pytest.raises(HyperparameterError) as info:
        FixedKnobs.parse(assignments)
    assert message in str(info.value)


def test_model_facts_must_be_consistent():
    with pytest.raises(HyperparameterError, match=r"world_size .* must equal nnodes"):
        ModelFacts(world_size=3, nnodes=2, local_world_size=2, gradient_bytes=10)
    with pytest.raises(HyperparameterError, match="gradient_bytes must be in"):
        ModelFacts(world_size=2, nnodes=1, local_world_size=2, gradient_bytes=0)


def test_importing_space_and_package_does_not_import_torch():
    code = "import distune, distune.space, sys; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    ("hp", "text"),
    [
        (Hyperparameters(22, False), "bucket 2^22 B (4 MiB), flat"),
        (Hyperparameters(16, True), "bucket 2^16 B (64 KiB), hierarchical"),
        (Hyperparameters(31, False), "bucket 2^31 B (2 GiB), flat"),
        (Hyperparameters(48, False), "bucket 2^48 B (256 TiB), flat"),
        (Hyperparameters(3, False), "bucket 2^3 B (8 B), flat"),
    ],
)
def test_describe_is_short_and_human(hp, text):
    assert hp.describe() == text
