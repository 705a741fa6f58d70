"""The robust score's precision: what trimming the windows costs, against a seeded simulation."""

import random
import statistics

import pytest

from distune.tuning_service.score import robust_throughput, trimmed_variance_factor


def simulated_factor(n: int, runs: int = 4000) -> float:
    """The variance of the trimmed mean of ``n`` normal log rates over that of their mean."""
    rng = random.Random(n)
    scores = [
        robust_throughput([1.0 + 0.01 * rng.gauss(0.0, 1.0) for _ in range(n)]) for _ in range(runs)
    ]
    return statistics.variance(scores) / (0.01**2 / n)


class TestTrimmedVarianceFactor:
    @pytest.mark.parametrize("n", [1, 2])
    def test_nothing_is_trimmed_from_two_windows_or_fewer(self, n):
        assert trimmed_variance_factor(n) == 1.0

    @pytest.mark.parametrize("n", [3, 5, 8, 20])
    def test_it_matches_the_simulated_variance_of_the_trimmed_mean(self, n):
        # 4000 runs: the simulated ratio is within ~5% of its expectation.
        assert trimmed_variance_factor(n) == pytest.approx(simulated_factor(n), rel=0.12)

    def test_the_median_of_three_costs_most_and_many_windows_about_14_percent(self):
        assert trimmed_variance_factor(3) > trimmed_variance_factor(5) > 1.1
        assert trimmed_variance_factor(1000) == pytest.approx(1.14, abs=0.01)
