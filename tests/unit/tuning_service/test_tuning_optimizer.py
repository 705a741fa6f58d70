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


def _initial_design(budget: int | None, seed: int) -> list[Hyperparameters]:
    optimizer = GroupOptimizer(SPACE, OptimizerSettings(), seed=seed, budget=budget)
    optimizer.tell(SPACE.default, throughput(SPACE.default))
    design = []
    while (suggestion := optimizer.suggest()).expected_improvement is None:
        design.append(suggestion.hyperparameters)
        optimizer.tell(suggestion.hyperparameters, throughput(suggestion.hyperparameters))
    return design


@pytest.mark.parametrize("seed", range(5))
def test_a_small_budget_keeps_the_initial_design_to_the_middle_of_the_range(seed):
    """Buckets 2^16..2^24: the middle 60% is 2^18..2^22. With 10 samples or fewer the design
    stays there, both shapes included; with more it spreads to the ends of the range."""
    small = _initial_design(budget=10, seed=seed)
    assert len(small) == 3
    assert all(18 <= hp.bucket_size_2p <= 22 for hp in small)
    assert {hp.is_hierarchical_reduce for hp in small} == {False, True}
    large = _initial_design(budget=11, seed=seed)
    assert min(hp.bucket_size_2p for hp in large) == 16  # the far end from the default's 2^24
    assert _initial_design(budget=None, seed=seed) == large


@pytest.mark.parametrize(
    "change, message",
    [
        ({"acquisition": "UCB"}, "acquisition must be one of EI, PI, LCB; got 'UCB'"),
        ({"small_budget": -1}, "small_budget"),
        ({"small_budget_share": 0.0}, r"small_budget_share must be in \(0, 1\], got 0.0"),
        ({"small_budget_share": 1.5}, "small_budget_share"),
    ],
)
def test_bad_settings_are_refused_by_name(change, message):
    with pytest.raises(ConfigError, match=message):
        OptimizerSettings(**change)
