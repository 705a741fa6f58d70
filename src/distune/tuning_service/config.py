"""Tuning settings: one frozen dataclass the service, the launcher's flag defaults and the
tuner-quality benchmark all read.

This module imports neither Flask nor scikit-optimize, so the launcher can take its defaults
from here without paying for either.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any

from distune.space import DEFAULT_BUCKET_SIZE, FixedKnobs


class ConfigError(ValueError):
    """A tuning setting holds a value it may not; the message names it and what is allowed."""


def _check_int(name: str, value: Any, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if not low <= value <= high:
        raise ConfigError(f"{name} must be in [{low}, {high}], got {value}")


def _check_number(name: str, value: Any, low: float, high: float, *, low_open: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(f"{name} must be a number, got {value!r}")
    above_low = value > low if low_open else value >= low
    if not (math.isfinite(value) and above_low and value <= high):
        bracket = "(" if low_open else "["
        raise ConfigError(f"{name} must be in {bracket}{low:g}, {high:g}], got {value}")


#: Acquisition functions the optimizer offers (scikit-optimize's names).
ACQUISITION_FUNCTIONS = ("EI", "PI", "LCB")
#: Initial designs the optimizer offers: scikit-optimize's samplers, or greedy maximin.
INITIAL_DESIGNS = ("maximin", "random", "lhs", "halton", "sobol")
#: How the Gaussian process treats measurement noise: fitted (a white-noise kernel), or none.
NOISE_MODELS = ("gaussian", "none")


@dataclass(frozen=True)
class OptimizerSettings:
    """How the Bayesian optimizer proposes groups. The defaults were chosen by measurement on
    synthetic landscapes; docs/tuning_service.md has the figures (and
    benchmarks/tuner_quality/ the script that produces them).

    ``initial_points`` counts the default group, which is always measured first.
    ``xi`` (EI, PI) and ``kappa`` (LCB) are in units of log-throughput, so ``xi=0.01`` asks for
    about a 1% improvement. The search ends early once ``stop_min_groups`` groups, and at
    least ``stop_min_share`` of the model's ``max_samples`` in groups, have been measured and
    the largest expected improvement of any unmeasured group is below ``stop_improvement`` (a
    fraction of the best throughput; 0 disables early stopping).

    The greedy maximin design covers the whole bucket-size range, unless
    ``design_max_buckets_2p`` is set: then it keeps to bucket sizes that split the model's
    gradients into at most ``2**design_max_buckets_2p`` buckets (a prior from the gradient
    bytes alone; the Bayesian phase still searches the whole range). ``cost_aware``: the
    Bayesian phase divides the acquisition by the predicted cost of measuring a group.
    """

    acquisition: str = "EI"
    xi: float = 0.01
    kappa: float = 1.96
    initial_points: int = 4
    initial_design: str = "maximin"
    noise: str = "gaussian"
    stop_improvement: float = 0.002
    stop_min_groups: int = 8
    stop_min_share: float = 0.5
    design_max_buckets_2p: int | None = 8
    cost_aware: bool = True

    def __post_init__(self) -> None:
        for name, value, allowed in (
            ("acquisition", self.acquisition, ACQUISITION_FUNCTIONS),
            ("initial_design", self.initial_design, INITIAL_DESIGNS),
            ("noise", self.noise, NOISE_MODELS),
        ):
            if value not in allowed:
                raise ConfigError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")
        _check_number("xi", self.xi, 0.0, 1.0, low_open=False)
        _check_number("kappa", self.kappa, 0.0, 100.0, low_open=False)
        _check_int("initial_points", self.initial_points, 1, 100)
        _check_number("stop_improvement", self.stop_improvement, 0.0, 1.0, low_open=False)
        _check_int("stop_min_groups", self.stop_min_groups, 1, 10_000)
        _check_number("stop_min_share", self.stop_min_share, 0.0, 1.0, low_open=False)
        if self.design_max_buckets_2p is not None:
            _check_int("design_max_buckets_2p", self.design_max_buckets_2p, 0, 48)


@dataclass(frozen=True)
class TuningConfig:
    """Job-wide tuning settings (the launcher's ``--autotune_*`` flags map onto these).

    Times are seconds of the job's own reported time (the ``seconds`` of its reports), never
    the service's clock.

    - ``max_samples``: at most this many sampled groups (re-measurements included) per model.
    - ``sampling_confidence_time``: each sample lasts at least this long...
    - ``min_windows``: ...and holds at least this many scored report windows.
    - ``warmup_time``: reported time ignored at the start of a model's training.
    - ``fixed``: knobs pinned job-wide; they are removed from the search.
    - ``default_bucket_size``: bytes of the default group's bucket (rounded to a power of two).
    - ``seed``: seeds each model's optimizer (with the model's name), for reproducible runs;
      None draws a fresh seed.
    - ``confirm_top``: before completing, the best group and the runners-up within
      ``confirm_margin`` of it, up to this many, are measured a second time.
    - ``max_models``: how many models one service tunes at most.
    - ``stall_fraction``: a window whose rate is below this fraction of the median of its
      group's windows is a stall (a data-loader or checkpoint pause several windows long): it
      is not scored and does not count towards the sample's time or windows (0 disables).
    - ``max_windows``: a sample keeps at most this many windows; past it, neighbouring windows
      are merged in pairs (iterations and seconds added), so memory stays bounded however long
      a sample runs, while its time is still all counted.
    - ``early_end_windows``: an exploring sample whose first this many scored windows are all
      clearly slower than the best group ends there (0 disables): "clearly" is
      ``early_end_z`` standard deviations of a window's noise below the best group's score.
    - ``gain_confidence``: the confidence level of the interval on the gain over the default
      group; a group whose interval does not lie above zero is not measurably faster, and the
      session keeps the default instead.
    - ``retune_drift``: after completing, if the job's throughput stays more than this
      fraction below the chosen group's score for ``retune_drift_time`` reported seconds, the
      session reopens with ``retune_samples`` samples (None: never).
    """

    max_samples: int = 20
    sampling_confidence_time: float = 5.0
    min_windows: int = 3
    warmup_time: float = 10.0
    fixed: FixedKnobs = field(default_factory=FixedKnobs)
    default_bucket_size: int = DEFAULT_BUCKET_SIZE
    seed: int | None = None
    confirm_top: int = 2
    confirm_margin: float = 0.03
    max_models: int = 256
    stall_fraction: float = 0.25
    max_windows: int = 256
    optimizer: OptimizerSettings = field(default_factory=OptimizerSettings)
    early_end_windows: int = 2
    early_end_z: float = 3.0
    gain_confidence: float = 0.95
    retune_drift: float | None = None
    retune_drift_time: float = 60.0
    retune_samples: int = 6

    def __post_init__(self) -> None:
        _check_int("max_samples", self.max_samples, 1, 10_000)
        _check_number(
            "sampling_confidence_time", self.sampling_confidence_time, 0.0, 86_400.0, low_open=True
        )
        _check_int("min_windows", self.min_windows, 1, 1_000)
        _check_number("warmup_time", self.warmup_time, 0.0, 86_400.0, low_open=False)
        if not isinstance(self.fixed, FixedKnobs):
            raise ConfigError(f"fixed must be a FixedKnobs, got {self.fixed!r}")
        _check_int("default_bucket_size", self.default_bucket_size, 1, 2**48)
        if self.seed is not None:
            _check_int("seed", self.seed, 0, 2**32 - 1)
        _check_int("confirm_top", self.confirm_top, 0, 100)
        _check_number("confirm_margin", self.confirm_margin, 0.0, 1.0, low_open=False)
        _check_int("max_models", self.max_models, 1, 100_000)
        _check_number("stall_fraction", self.stall_fraction, 0.0, 0.9, low_open=False)
        _check_int("max_windows", self.max_windows, 8, 1_000_000)
        if not isinstance(self.optimizer, OptimizerSettings):
            raise ConfigError(f"optimizer must be an OptimizerSettings, got {self.optimizer!r}")
        _check_int("early_end_windows", self.early_end_windows, 0, 1_000)
        _check_number("early_end_z", self.early_end_z, 0.0, 100.0, low_open=False)
        _check_number("gain_confidence", self.gain_confidence, 0.5, 0.9999, low_open=False)
        if self.retune_drift is not None:
            _check_number("retune_drift", self.retune_drift, 0.0, 1.0, low_open=True)
        _check_number("retune_drift_time", self.retune_drift_time, 0.0, 86_400.0, low_open=True)
        _check_int("retune_samples", self.retune_samples, 1, 10_000)
