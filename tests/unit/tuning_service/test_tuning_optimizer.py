"""The skopt-backed group optimizer: proposals, duplicates, the initial design, errors."""

import math

import pytest

from distune.space import FixedKnobs, Hyperparameters, ModelFacts, SearchSpace
from distune.tuning_service.config import ConfigError, OptimizerSettings
from distune.tuning_service.optimizer import GroupOptimizer
from tests.support.models import MULTI_NODE as FACTS

SPACE = SearchSpace.for_model(FACTS)  # buckets 2^16..2^24, flat or hierarchical: 18 groups
SMALL = SearchSpace.for_model(ModelFacts(8, 2, 4, 2**19))  # 2^16..2^19: 8 groups


def throughput(hp: Hyperparameters) -> float:
    return 100.0 * math.exp(-(((hp.bucket_size_2p - 21) / 2.5) ** 2)) + (
        5.0 if hp.is_hierarchical_reduce else 10.0
    )


@pytest.mark.parametrize("design", ["maximin", "lhs", "halton", "sobol", "random"])
def test_never_proposes_a_measured_group_and_says_when_all_are(design):
    settings = OptimizerSettings(initial_design=design, initial_points=4)
    optimizer = GroupOptimizer(SMALL, settings, seed=0)
    optimizer.tell(SMALL.default, throughput(SMALL.default))
    seen = [SMALL.default]
    for step in range(SMALL.size - 1):
        suggestion = optimizer.suggest()
        hp = suggestion.hyperparameters
        assert hp in SMALL and hp not in seen
        assert (suggestion.expected_improvement is None) == (step < 3)  # the initial design
        optimizer.tell(hp, throughput(hp))
        seen.append(hp)
    assert optimizer.suggest() is None
    assert set(optimizer.scores) == set(SMALL)


def test_a_retold_group_replaces_its_score():
    optimizer = GroupOptimizer(SPACE, OptimizerSettings(), seed=0)
    optimizer.tell(SPACE.default, 10.0)
    optimizer.tell(SPACE.default, 12.0)
    assert optimizer.scores == {SPACE.default: 12.0}


def test_expected_improvement_fades_once_the_peak_is_measured():
    optimizer = GroupOptimizer(SPACE, OptimizerSettings(), seed=1)
    for hp in SPACE:
        if hp.bucket_size_2p % 2 == 0 or hp == Hyperparameters(21, False):
            optimizer.tell(hp, throughput(hp))
    suggestion = optimizer.suggest()
    assert suggestion.expected_improvement is not None
    assert suggestion.expected_improvement < 0.01  # in log-throughput: under 1% to gain


def test_finds_the_peak_of_a_smooth_landscape_in_few_proposals():
    optimizer = GroupOptimizer(SPACE, OptimizerSettings(), seed=2)
    optimizer.tell(SPACE.default, throughput(SPACE.default))
    for _ in range(8):
        hp = optimizer.suggest().hyperparameters
        optimizer.tell(hp, throughput(hp))
    best = max(optimizer.scores, key=optimizer.scores.get)
    assert best == Hyperparameters(21, False)


def test_fixed_knobs_leave_one_dimension():
    space = SearchSpace.for_model(FACTS, FixedKnobs(is_hierarchical_reduce=True))
    optimizer = GroupOptimizer(space, OptimizerSettings(initial_points=2), seed=0)
    optimizer.tell(space.default, 1.0)
    for _ in range(4):
        hp = optimizer.suggest().hyperparameters
        assert hp.is_hierarchical_reduce is True
        optimizer.tell(hp, throughput(hp))


def test_a_space_with_nothing_to_tune_is_refused():
    space = SearchSpace.for_model(FACTS, FixedKnobs(20, False))
    with pytest.raises(ValueError, match="nothing to optimize"):
        GroupOptimizer(space, OptimizerSettings(), seed=0)


@pytest.mark.parametrize("score", [0.0, -1.0, math.nan, math.inf])
def test_scores_must_be_positive_and_finite(score):
    optimizer = GroupOptimizer(SPACE, OptimizerSettings(), seed=0)
    with pytest.raises(ValueError, match="positive finite"):
        optimizer.tell(SPACE.default, score)


def test_asking_before_telling_is_an_error():
    with pytest.raises(RuntimeError, match="tell the optimizer"):
        GroupOptimizer(SPACE, OptimizerSettings(), seed=0).suggest()


LARGE = SearchSpace.for_model(ModelFacts(8, 2, 4, 2**30))  # buckets 2^16..2^30


def _initial_design(settings: OptimizerSettings, seed: int) -> list[Hyperparameters]:
    optimizer = GroupOptimizer(LARGE, settings, seed=seed)
    optimizer.tell(LARGE.default, 1.0)
    design = []
    while (suggestion := optimizer.suggest()).expected_improvement is None:
        design.append(suggestion.hyperparameters)
        optimizer.tell(suggestion.hyperparameters, 1.0)
    return design


@pytest.mark.parametrize("seed", range(5))
def test_the_initial_design_keeps_to_at_most_2_to_the_8_buckets_or_covers_the_range(seed):
    """A 2^30-byte model: at most 2^8 buckets means buckets of 2^22 and up. The design keeps
    there, both shapes included; without the prior it reaches below 2^22."""
    design = _initial_design(OptimizerSettings(), seed)
    assert len(design) == 3
    assert all(22 <= hp.bucket_size_2p <= 30 for hp in design)
    assert {hp.is_hierarchical_reduce for hp in design} == {False, True}
    whole = _initial_design(OptimizerSettings(max_buckets_2p=None), seed)
    assert min(hp.bucket_size_2p for hp in whole) < 22


def _search(settings: OptimizerSettings, limit: int) -> list[Hyperparameters]:
    """The groups the optimizer proposes, up to ``limit`` or until it says nothing is left, on
    a landscape whose best group is the smallest bucket (2^16 B: 2^14 buckets of a 2^30-byte
    model)."""
    optimizer = GroupOptimizer(LARGE, settings, seed=0)
    optimizer.tell(LARGE.default, 1.0)
    proposed: list[Hyperparameters] = []
    while len(proposed) < limit and (suggestion := optimizer.suggest()) is not None:
        hp = suggestion.hyperparameters
        proposed.append(hp)
        optimizer.tell(hp, 100.0 / (1 + hp.bucket_size_2p - 16))
    return proposed


def test_the_bayesian_phase_keeps_to_the_prior_and_stops_when_it_is_measured():
    """At most 2^4 buckets of a 2^30-byte model: buckets of 2^26 to 2^30, both shapes, 10
    groups; the search measures them all and no other, however the scores point below. With
    the prior off it goes there."""
    within = _search(OptimizerSettings(max_buckets_2p=4), limit=20)
    assert len(within) == len(set(within)) == 10  # the default (2^25 B) lies below the prior
    assert all(hp.bucket_size_2p >= 26 for hp in within)
    whole = _search(OptimizerSettings(max_buckets_2p=None), limit=6)
    assert min(hp.bucket_size_2p for hp in whole) < 26


@pytest.mark.parametrize("seed", range(5))
def test_the_initial_design_spreads_over_the_middles_of_the_range_not_its_ends(seed):
    """Greedy maximin with the range's ends mirrored: the first point on the other shape lies
    at the middle of the range, and none at its ends, which hold the optimum no more often
    than any other stretch."""
    whole = _initial_design(OptimizerSettings(max_buckets_2p=None, initial_points=6), seed)
    assert len(whole) == 5
    assert whole[0] == Hyperparameters(23, True)  # the middle of 2^16..2^30
    assert all(16 < hp.bucket_size_2p < 30 for hp in whole)
    sizes = sorted(hp.bucket_size_2p for hp in [LARGE.default, *whole])
    assert sizes[-1] - sizes[0] >= 7  # spread, not bunched


@pytest.mark.parametrize(
    "change, message",
    [
        ({"acquisition": "UCB"}, "acquisition must be one of EI, PI, LCB; got 'UCB'"),
        ({"max_buckets_2p": -1}, r"max_buckets_2p must be in \[0, 48\]"),
        ({"max_buckets_2p": 1.5}, "max_buckets_2p must be an integer"),
    ],
)
def test_bad_settings_are_refused_by_name(change, message):
    with pytest.raises(ConfigError, match=message):
        OptimizerSettings(**change)
