"""Properties of space.py for any input hypothesis finds: round trips, clamping, and
``point``/``complete`` as inverses."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distune.space import (
    BUCKET_SIZE_2P_LIMITS,
    KNOB_NAMES,
    MIN_TUNED_BUCKET_SIZE_2P,
    FixedKnobs,
    HyperparameterError,
    Hyperparameters,
    ModelFacts,
    SearchSpace,
    bucket_size_2p_for,
)

EXPONENTS = st.integers(*BUCKET_SIZE_2P_LIMITS)
HYPERPARAMETERS = st.builds(Hyperparameters, EXPONENTS, st.booleans())
FIXED = st.builds(FixedKnobs, st.none() | EXPONENTS, st.none() | st.booleans())
# Not a knob value: out of range, wrong type, or a bool passed as an integer.
NOT_AN_EXPONENT = (
    st.integers(max_value=BUCKET_SIZE_2P_LIMITS[0] - 1)
    | st.integers(min_value=BUCKET_SIZE_2P_LIMITS[1] + 1)
    | st.booleans()
    | st.floats()
    | st.text(max_size=3)
)
NOT_A_BOOL = st.integers() | st.floats() | st.text(max_size=3) | st.none()


@st.composite
def facts(draw) -> ModelFacts:
    nnodes = draw(st.integers(1, 64))
    local = draw(st.integers(1, 16))
    return ModelFacts(nnodes * local, nnodes, local, draw(st.integers(1, 2**48)))


@given(HYPERPARAMETERS)
def test_hyperparameters_round_trip_through_their_json_form(hp):
    assert Hyperparameters.from_dict(hp.to_dict()) == hp
    assert hp.bucket_size == 2**hp.bucket_size_2p


@given(NOT_AN_EXPONENT, st.booleans())
def test_invalid_bucket_exponents_are_refused_by_name(exponent, hierarchical):
    with pytest.raises(HyperparameterError, match="bucket_size_2p"):
        Hyperparameters(exponent, hierarchical)
    with pytest.raises(HyperparameterError, match="bucket_size_2p"):
        FixedKnobs(bucket_size_2p=exponent)


@given(EXPONENTS, NOT_A_BOOL)
def test_non_booleans_are_refused_by_name(exponent, hierarchical):
    with pytest.raises(HyperparameterError, match="is_hierarchical_reduce"):
        Hyperparameters(exponent, hierarchical)


@given(st.dictionaries(st.text(max_size=20), st.integers(16, 20), max_size=3))
def test_from_dict_needs_exactly_the_knobs(data):
    if sorted(data) == sorted(KNOB_NAMES):
        return  # a bool-valued knob holds an int here: covered above
    with pytest.raises(HyperparameterError):
        Hyperparameters.from_dict(data)


@given(FIXED)
def test_fixed_knobs_round_trip_through_dict_and_command_line(fixed):
    assert FixedKnobs.from_dict(fixed.to_dict()) == fixed
    assignments = [f"{name}={str(value).lower()}" for name, value in fixed.to_dict().items()]
    assert FixedKnobs.parse(assignments) == fixed


@given(st.integers(1, 2**48))
def test_bucket_size_exponent_is_the_nearest_power_of_two_in_log_scale(size):
    exponent = bucket_size_2p_for(size)
    assert BUCKET_SIZE_2P_LIMITS[0] <= exponent <= BUCKET_SIZE_2P_LIMITS[1]
    assert abs(exponent - math.log2(size)) <= 0.5
    assert bucket_size_2p_for(2**exponent) == exponent


@settings(max_examples=150)
@given(facts(), FIXED, st.integers(1, 2**48))
def test_the_space_holds_its_default_and_clamps_into_range(model, fixed, default_size):
    space = SearchSpace.for_model(model, fixed, default_size)
    top = max(MIN_TUNED_BUCKET_SIZE_2P, math.ceil(math.log2(model.gradient_bytes)))
    assert space.default in space
    assert space.max_bucket_size_2p <= top
    if fixed.bucket_size_2p is None:
        assert (space.min_bucket_size_2p, space.max_bucket_size_2p) == (16, top)
    else:  # a fixed bucket above the model's top is the same one bucket: clamped to it
        assert space.min_bucket_size_2p == space.max_bucket_size_2p
        assert space.max_bucket_size_2p == min(fixed.bucket_size_2p, top)
    wanted = bucket_size_2p_for(default_size)
    low, high = space.min_bucket_size_2p, space.max_bucket_size_2p
    assert space.default.bucket_size_2p == min(max(wanted, low), high)
    if not model.hierarchical_possible:
        assert space.hierarchical_choices == (False,)
    elif fixed.is_hierarchical_reduce is not None:
        assert space.hierarchical_choices == (fixed.is_hierarchical_reduce,)
    else:
        assert space.hierarchical_choices == (False, True)
    assert space.default.is_hierarchical_reduce == (False not in space.hierarchical_choices)


@settings(max_examples=100)
@given(facts(), FIXED)
def test_point_and_complete_are_inverses_over_the_whole_space(model, fixed):
    space = SearchSpace.for_model(model, fixed)
    groups = list(space)
    assert len(groups) == len(set(groups)) == space.size
    assert (space.size > 1) == bool(space.tuned)
    for hp in groups:
        assert hp in space
        point = space.point(hp)
        assert len(point) == len(space.tuned)
        assert space.complete(point) == hp


@given(facts(), FIXED, HYPERPARAMETERS)
def test_groups_outside_the_space_have_no_point(model, fixed, hp):
    space = SearchSpace.for_model(model, fixed)
    if hp in space:
        assert space.complete(space.point(hp)) == hp
    else:
        with pytest.raises(HyperparameterError, match="outside the search space"):
            space.point(hp)


@given(facts(), st.lists(st.integers(-100, 100) | st.booleans(), max_size=3))
def test_complete_refuses_points_outside_the_space(model, point):
    space = SearchSpace.for_model(model)
    try:
        hp = space.complete(point)
    except HyperparameterError:
        return
    assert hp in space and space.point(hp) == [getattr(hp, n) for n in space.tuned]


@given(st.integers(1, 64), st.integers(1, 16), st.integers(1, 2**48), st.integers(1, 1000))
def test_inconsistent_topologies_are_refused(nnodes, local, gradient_bytes, world_size):
    if world_size == nnodes * local:
        assert ModelFacts(world_size, nnodes, local, gradient_bytes).world_size == world_size
    else:
        with pytest.raises(HyperparameterError, match="world_size"):
            ModelFacts(world_size, nnodes, local, gradient_bytes)
