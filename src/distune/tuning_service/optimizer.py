"""The Bayesian optimizer of one model's search space: scikit-optimize's ``Optimizer`` with a
Gaussian process, over the knobs the space tunes.

The space is small and discrete (at most a few dozen groups), so instead of letting skopt
sample the acquisition function at random points, :meth:`GroupOptimizer.suggest` evaluates it
on every unmeasured group and proposes the best. Measured groups are never proposed: another
look at one teaches the model nothing about the others, and skopt would swap such a duplicate
for a random point. Re-measuring is the session's business (it confirms its best groups before
choosing), and so is stopping, for which :class:`Suggestion` carries the expected improvement.

The objective is ``-ln(throughput)``: skopt minimises, and in log space the multiplicative noise
of real measurements becomes additive and the improvement thresholds become relative.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from skopt import Optimizer
from skopt.acquisition import gaussian_ei, gaussian_lcb, gaussian_pi
from skopt.learning import GaussianProcessRegressor
from skopt.sampler import Halton, Lhs, Sobol
from skopt.space import Categorical, Integer, Space
from skopt.utils import cook_estimator, normalize_dimensions

from distune.space import BUCKET_SIZE_2P, IS_HIERARCHICAL_REDUCE, Hyperparameters, SearchSpace
from distune.tuning_service.config import OptimizerSettings

_SAMPLERS = {"lhs": Lhs, "halton": Halton, "sobol": Sobol}
# A GP with no noise term still needs a jitter on its diagonal to stay positive definite.
_NOISE_FREE_JITTER = 1e-8


@dataclass(frozen=True)
class Suggestion:
    """The optimizer's next group, always one not measured yet, and what it expects of it.

    ``expected_improvement`` is the largest expected relative gain over the incumbent (EI
    without margin, in log-throughput) of any unmeasured group; None while the initial design
    runs.
    """

    hyperparameters: Hyperparameters
    expected_improvement: float | None


class GroupOptimizer:
    """Proposes groups of ``space`` from the scores it is told; one per model, not thread-safe
    (the session's lock guards it)."""

    def __init__(
        self,
        space: SearchSpace,
        settings: OptimizerSettings,
        seed: int | None,
    ) -> None:
        if not space.tuned:
            raise ValueError("the search space tunes no knob: there is nothing to optimize")
        self._space = space
        self._settings = settings
        self._rng = np.random.default_rng(seed)
        self._dimensions = [_dimension(space, name) for name in space.tuned]
        self._fit_seed = self._draw_seed()
        self._groups = list(space)
        self._transformed = Space(normalize_dimensions(self._dimensions)).transform(
            [space.point(hp) for hp in self._groups]
        )
        self._scores: dict[Hyperparameters, float] = {}
        self._model: GaussianProcessRegressor | None = None
        self._design = self._initial_design()
        self._prior_sizes = _prior_bounds(space, settings.max_buckets_2p)

    @property
    def scores(self) -> dict[Hyperparameters, float]:
        """The score told for each measured group."""
        return dict(self._scores)

    def tell(self, hp: Hyperparameters, score: float) -> None:
        """Record the throughput ``score`` (> 0) of ``hp``: its best estimate so far, which
        replaces any earlier one (a re-measured group is told its pooled score)."""
        if not (math.isfinite(score) and score > 0):
            raise ValueError(f"a score must be a positive finite throughput, got {score}")
        self._scores[hp] = score
        self._model = None  # refitted when next asked

    def suggest(self, cost: Callable[[np.ndarray], np.ndarray] | None = None) -> Suggestion | None:
        """The unmeasured group to measure next, or None once every group within the prior
        (``max_buckets_2p``) has been measured. Needs at least one score.

        ``cost`` maps each candidate's predicted slowdown against the incumbent (predicted
        step time over the incumbent's, >= 0) to the relative cost of measuring it; the
        Bayesian phase then proposes the group of largest acquisition per unit of cost, so a
        region the measurements show to be hopeless (where even a sample ended early takes
        long) is left alone."""
        if not self._scores:
            raise RuntimeError("tell the optimizer a score before asking it for a group")
        low, high = self._prior_sizes
        unmeasured = [
            i
            for i, hp in enumerate(self._groups)
            if hp not in self._scores and low <= hp.bucket_size_2p <= high
        ]
        if not unmeasured:
            return None
        if len(self._scores) < self._settings.initial_points:
            return Suggestion(self._next_initial(unmeasured), None)
        model = self._fit()
        measured = [i for i, hp in enumerate(self._groups) if hp in self._scores]
        # The incumbent is the best *predicted* value at a measured group, not the luckiest
        # observation: with noisy scores the latter would make every other group look hopeless.
        y_opt = float(np.min(model.predict(self._transformed[measured])))
        candidates = self._transformed[unmeasured]
        settings = self._settings
        if settings.acquisition == "EI":
            values = gaussian_ei(candidates, model, y_opt=y_opt, xi=settings.xi)
        elif settings.acquisition == "PI":
            values = gaussian_pi(candidates, model, y_opt=y_opt, xi=settings.xi)
        else:
            values = -gaussian_lcb(candidates, model, kappa=settings.kappa)
        if cost is not None:
            slowdown = np.exp(model.predict(candidates) - y_opt)
            values = values / cost(slowdown)
        best = unmeasured[int(np.argmax(values))]
        improvement = float(np.max(gaussian_ei(candidates, model, y_opt=y_opt, xi=0.0)))
        return Suggestion(self._groups[best], improvement)

    def _fit(self) -> GaussianProcessRegressor:
        if self._model is not None:
            return self._model
        # One observation per group, its pooled estimate, rather than one per sample: a single
        # wild sample then cannot inflate the GP's noise level until every group looks alike.
        # skopt's Optimizer has no way to replace an observation, so each fit starts afresh.
        optimizer = Optimizer(
            self._dimensions,
            base_estimator=self._estimator(),
            n_initial_points=1,
            acq_optimizer="sampling",
            acq_optimizer_kwargs={"n_points": 1},  # its own acquisition search is unused
            random_state=self._fit_seed,
        )
        with warnings.catch_warnings():
            # The GP fit warns about convergence of its kernel parameters on tiny data sets.
            warnings.simplefilter("ignore")
            optimizer.tell(
                [self._space.point(hp) for hp in self._scores],
                [-math.log(score) for score in self._scores.values()],
            )
        self._model = optimizer.models[-1]
        return self._model

    def _draw_seed(self) -> int:
        return int(self._rng.integers(0, 2**31 - 1))

    def _estimator(self) -> GaussianProcessRegressor:
        noise = "gaussian" if self._settings.noise == "gaussian" else _NOISE_FREE_JITTER
        # No restarts of the kernel fit: the space is tiny and a restart multiplies a fit's
        # cost, which is paid inside a report request.
        return cook_estimator(
            "GP",
            space=self._dimensions,
            noise=noise,
            n_restarts_optimizer=0,
            random_state=self._fit_seed,
        )

    def _initial_design(self) -> list[Hyperparameters]:
        design = self._settings.initial_design
        n = self._settings.initial_points
        if design == "maximin":
            return []  # chosen greedily from what has been measured, see _next_initial
        if design == "random":
            points = Space(self._dimensions).rvs(n_samples=n, random_state=self._draw_seed())
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # Sobol warns about non-power-of-two counts
                sampler = _SAMPLERS[design]()
                points = sampler.generate(self._dimensions, n, random_state=self._draw_seed())
        return [self._space.complete(list(point)) for point in points]

    def _next_initial(self, unmeasured: list[int]) -> Hyperparameters:
        """The next group of the initial design, one of the ``unmeasured`` (within the prior)."""
        allowed = {self._groups[i] for i in unmeasured}
        for hp in self._design:
            if hp in allowed:
                return hp
        # Greedy maximin: the unmeasured group farthest from every measured one, where the
        # edges of the prior's bucket range count as measured groups mirrored beyond them.
        # Plain maximin on a line goes to its ends first, which hold the optimum no more
        # often than any other stretch (the random draws put it anywhere); mirrored, the
        # points land at the middles of equal stretches, as a centred Latin hypercube's do.
        # Sampled designs fall back to it once their points are used up or repeat measured
        # groups.
        low, high = self._prior_sizes
        measured = self._transformed[[i for i, hp in enumerate(self._groups) if hp in self._scores]]
        candidates = self._transformed[unmeasured]
        distances = np.linalg.norm(candidates[:, None, :] - measured[None, :, :], axis=2).min(
            axis=1
        )
        if BUCKET_SIZE_2P in self._space.tuned and high > low:
            column = self._space.tuned.index(BUCKET_SIZE_2P)
            span = self._space.max_bucket_size_2p - self._space.min_bucket_size_2p
            edges = (np.array([low, high]) - self._space.min_bucket_size_2p) / span
            x = candidates[:, column]
            distances = np.minimum(distances, 2 * np.minimum(x - edges[0], edges[1] - x))
        farthest = np.flatnonzero(distances >= distances.max() - 1e-12)
        return self._groups[unmeasured[int(self._rng.choice(farthest))]]


def _prior_bounds(space: SearchSpace, max_buckets_2p: int | None) -> tuple[float, float]:
    """The bucket sizes (log2) the search keeps to: the whole range, or with
    ``max_buckets_2p`` those that split the gradients into at most 2**max_buckets_2p buckets
    (the space's top is the first power of two at or above the gradient bytes)."""
    low, high = space.min_bucket_size_2p, space.max_bucket_size_2p
    if max_buckets_2p is None:
        return low, high
    return max(low, high - max_buckets_2p), high


def _dimension(space: SearchSpace, name: str) -> Integer | Categorical:
    if name == BUCKET_SIZE_2P:
        return Integer(space.min_bucket_size_2p, space.max_bucket_size_2p, name=name)
    if name == IS_HIERARCHICAL_REDUCE:
        return Categorical(list(space.hierarchical_choices), name=name)
    raise ValueError(f"no optimizer dimension for knob {name!r}")
