"""Tuning settings: the one declaration of each setting the tuning service takes.

Each field of :class:`TuningConfig` (and :class:`OptimizerSettings`) declares, in its metadata
(a :class:`Setting`), what it means, the rule its value must follow and whether the service has
a flag for it. From that one declaration come the service's flags (``server.py``), the
launcher's matching ``--autotune_*`` flags, their config-file keys and the README's table
(``launcher/options.py``), and the validation in ``__post_init__``: adding a tuning option is
one field here plus its use. docs/architecture.md shows the flow.

This module imports neither Flask nor scikit-optimize (nor torch), so the launcher can read it
without paying for either.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import Field, dataclass, field, fields
from typing import Any

from distune.checks import InvalidValue, integer_in, number_in
from distune.errors import ConfigError
from distune.space import DEFAULT_BUCKET_SIZE, FixedKnobs


@dataclass(frozen=True)
class Setting:
    """The declaration of one tuning setting, held in its dataclass field's metadata.

    ``check`` returns the value or raises :class:`~distune.checks.InvalidValue`; ``help`` says
    what the setting means (the flags' help and the README say it in these words); with
    ``flag`` the service takes it as ``--name-with-dashes`` (``metavar`` names its value).
    """

    help: str
    check: Callable[[Any], Any]
    metavar: str | None = None
    flag: bool = False


def setting(
    default: Any,
    help: str,
    check: Callable[[Any], Any],
    *,
    metavar: str | None = None,
    flag: bool = False,
    factory: Callable[[], Any] | None = None,
) -> Any:
    """A dataclass field declared as a :class:`Setting` (``factory`` for mutable defaults)."""
    metadata = {"setting": Setting(help, check, metavar, flag)}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def declared(cls: type) -> Iterator[tuple[Field[Any], Setting]]:
    """The fields of the dataclass ``cls`` with their declarations, in order."""
    for item in fields(cls):
        declaration = item.metadata.get("setting")
        if declaration is not None:
            yield item, declaration


def value_type(cls: type, name: str) -> type:
    """The type of field ``name`` of ``cls`` (``int`` for ``int | None``), for parsing text."""
    hint = typing.get_type_hints(cls)[name]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(arg for arg in typing.get_args(hint) if arg is not type(None))
    return typing.cast(type, hint)


def setting_table(cls: type) -> str:
    """A markdown table of the declared settings of ``cls`` (field, default, meaning), as
    docs/tuning_service.md shows them; a test keeps the page equal to it."""
    rows = ["| field | default | meaning |", "|---|---|---|"]
    defaults = cls()
    for item, declaration in declared(cls):
        default = getattr(defaults, item.name)
        if isinstance(default, float):
            shown = f"{default:g}"
        elif hasattr(default, "__dataclass_fields__"):
            shown = f"{type(default).__name__}()"
        else:
            shown = str(default)
        rows.append(f"| `{item.name}` | {shown} | {declaration.help} |")
    return "\n".join(rows) + "\n"


def _validate(instance: Any) -> None:
    """Run every declared check of a settings dataclass; ConfigError names the field."""
    for item, declaration in declared(type(instance)):
        try:
            declaration.check(getattr(instance, item.name))
        except InvalidValue as error:
            raise ConfigError(f"{item.name} {error}") from None


def _integer(low: int, high: int) -> Callable[[Any], int]:
    return lambda value: integer_in(value, low, high)


def _number(low: float, high: float, *, low_open: bool = False) -> Callable[[Any], float]:
    return lambda value: number_in(value, low, high, low_open=low_open)


def _optional(check: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda value: None if value is None else check(value)


def _zero_or(check: Callable[[Any], float]) -> Callable[[Any], float]:
    """0 (off), or a value ``check`` accepts."""

    def zero_or(value: Any) -> float:
        if value == 0 and not isinstance(value, bool):
            return 0.0
        try:
            return check(value)
        except InvalidValue as error:
            reason = str(error.args[0]).removeprefix("must be ")
            raise InvalidValue(f"must be 0 (off) or {reason}") from None

    return zero_or


def _one_of(allowed: tuple[str, ...]) -> Callable[[Any], str]:
    def check(value: Any) -> str:
        if value not in allowed:
            raise InvalidValue(f"must be one of {', '.join(allowed)}; got {value!r}")
        return str(value)

    return check


def _instance(kind: type) -> Callable[[Any], Any]:
    def check(value: Any) -> Any:
        if not isinstance(value, kind):
            raise InvalidValue(f"must be a {kind.__name__}, got {value!r}")
        return value

    return check


#: Acquisition functions the optimizer offers (scikit-optimize's names).
ACQUISITION_FUNCTIONS = ("EI", "PI", "LCB")
#: Initial designs the optimizer offers: scikit-optimize's samplers, or greedy maximin.
INITIAL_DESIGNS = ("maximin", "random", "lhs", "halton", "sobol")
#: How the Gaussian process treats measurement noise: fitted (a white-noise kernel), or none.
NOISE_MODELS = ("gaussian", "none")


@dataclass(frozen=True)
class OptimizerSettings:
    """How the Bayesian optimizer proposes groups: no flags, set in code (the tuner-quality
    benchmark varies them). The defaults were chosen by measurement on synthetic landscapes;
    docs/tuning_service.md has the figures and benchmarks/tuner_quality/ the script.
    """

    acquisition: str = setting(
        "EI", "scikit-optimize's acquisition function", _one_of(ACQUISITION_FUNCTIONS)
    )
    xi: float = setting(
        0.01,
        "EI and PI's exploration, in log-throughput (0.01 asks for about 1% improvement)",
        _number(0.0, 1.0),
    )
    kappa: float = setting(1.96, "LCB's exploration, in log-throughput", _number(0.0, 100.0))
    initial_points: int = setting(
        4, "groups of the initial design, the default group included", _integer(1, 100)
    )
    initial_design: str = setting(
        "maximin", "how the initial groups are spread", _one_of(INITIAL_DESIGNS)
    )
    noise: str = setting(
        "gaussian", "how the Gaussian process treats measurement noise", _one_of(NOISE_MODELS)
    )
    stop_improvement: float = setting(
        0.002,
        "stop early once no unmeasured group is expected to improve the best throughput by "
        "this fraction (0: never stop early)",
        _number(0.0, 1.0),
    )
    stop_min_groups: int = setting(8, "groups measured before an early stop", _integer(1, 10_000))
    stop_min_share: float = setting(
        0.5, "share of max_samples measured before an early stop", _number(0.0, 1.0)
    )
    max_buckets_2p: int | None = setting(
        8,
        "the search (initial design and Bayesian phase) keeps to bucket sizes that split the "
        "gradients into at most 2**this buckets, a prior from the gradient bytes alone (none: "
        "the whole range); the default group is measured wherever it lies",
        _optional(_integer(0, 48)),
    )
    cost_aware: bool = setting(
        True,
        "the Bayesian phase divides the acquisition by the predicted cost of measuring a "
        "group, so regions measured to be hopeless are left alone",
        _instance(bool),
    )

    def __post_init__(self) -> None:
        _validate(self)


@dataclass(frozen=True)
class TuningConfig:
    """Job-wide tuning settings; the launcher's ``--autotune_*`` flags map onto the ones with
    a service flag. Times are seconds of the job's own reported time (the ``seconds`` of its
    reports), never the service's clock.
    """

    max_samples: int = setting(
        20,
        "at most N sampled groups per model, re-measurements included",
        _integer(1, 10_000),
        metavar="N",
        flag=True,
    )
    sampling_confidence_time: float = setting(
        5.0,
        "seconds each group is measured",
        _number(0.0, 86_400.0, low_open=True),
        metavar="T",
        flag=True,
    )
    min_windows: int = setting(
        3, "scored report windows each sample holds at least", _integer(1, 1_000)
    )
    warmup_time: float = setting(
        10.0, "seconds ignored at the start", _number(0.0, 86_400.0), metavar="W", flag=True
    )
    fixed: FixedKnobs = setting(
        None,
        "knobs pinned job-wide; they are removed from the search",
        _instance(FixedKnobs),
        factory=FixedKnobs,
    )
    default_bucket_size: int = setting(
        DEFAULT_BUCKET_SIZE,
        "bytes of the default group's bucket (rounded to a power of two)",
        _integer(1, 2**48),
        metavar="BYTES",
        flag=True,
    )
    seed: int | None = setting(
        None,
        "seed of each model's optimizer (with the model's name), for reproducible runs; "
        "none: a fresh one",
        _optional(_integer(0, 2**32 - 1)),
        metavar="S",
        flag=True,
    )
    confirm_top: int = setting(
        2,
        "before completing, the best group and the runners-up within confirm_margin of it, up "
        "to this many, are measured again",
        _integer(0, 100),
    )
    confirm_margin: float = setting(
        0.03,
        "runners-up within this fraction of the best are confirmed; before completing with "
        "budget left, every group measured once within it is",
        _number(0.0, 1.0),
    )
    close_call_time: float = setting(
        80.0,
        "a close call's sample (the best group against the default while the gain is not "
        "proven, or two near-equal confirmed groups) runs this many times "
        "sampling_confidence_time and min_windows, in legs of one sampling time that "
        "alternate the two",
        _number(1.0, 100.0),
        metavar="K",
        flag=True,
    )
    proven_fallback: bool = setting(
        True,
        "when the best-scored confirmed group is not measurably faster than the default, the "
        "session completes on the best-scored one that is (if any) rather than the default",
        _instance(bool),
    )
    settle_runners_up: bool = setting(
        True,
        "before completing with budget left, the best-scored confirmed group and a confirmed "
        "group within confirm_margin of it that it has not met in a close call meet in one",
        _instance(bool),
    )
    max_models: int = setting(
        256,
        "how many model sessions the service tunes at most (a model registered again with "
        "other facts counts again)",
        _integer(1, 100_000),
        metavar="N",
        flag=True,
    )
    stall_fraction: float = setting(
        0.25,
        "a window below this fraction of its group's median rate is a stall (a loader or "
        "checkpoint pause): not scored, not counted (0: none)",
        _number(0.0, 0.9),
    )
    max_windows: int = setting(
        4096,
        "windows a sample keeps; past it neighbours are merged in pairs, so memory stays "
        "bounded while all time is counted",
        _integer(8, 1_000_000),
    )
    optimizer: OptimizerSettings = setting(
        None,
        "how the Bayesian optimizer proposes groups",
        _instance(OptimizerSettings),
        factory=OptimizerSettings,
    )
    early_end_windows: int = setting(
        2,
        "an exploring sample whose first this many scored windows are all clearly slower "
        "than the best group ends there, scored with them (0: never)",
        _integer(0, 1_000),
    )
    early_end_z: float = setting(
        3.0,
        "clearly slower: this many standard deviations of a window's noise below the best "
        "group's score",
        _number(0.0, 100.0),
    )
    hopeless_slowdown: float = setting(
        4.0,
        "an exploring sample whose switch window is this many times slower than the best "
        "group, even less twice the dearest switch measured so far, ends at that window, "
        "scored with it (0: never)",
        _zero_or(_number(1.0, 1_000_000.0)),
    )
    gain_confidence: float = setting(
        0.95,
        "confidence level of the interval on the gain over the default group; a group whose "
        "interval does not lie above zero is not chosen over the default",
        _number(0.5, 0.9999),
    )
    retune_drift: float | None = setting(
        None,
        "after completion, reopen tuning with a small budget when the throughput stays more "
        "than this fraction below the chosen group's score for retune_drift_time seconds",
        _optional(_number(0.0, 1.0, low_open=True)),
        metavar="FRACTION",
        flag=True,
    )
    retune_drift_time: float = setting(
        60.0,
        "seconds the throughput must stay below the drift threshold before tuning reopens",
        _number(0.0, 86_400.0, low_open=True),
    )
    retune_samples: int = setting(6, "samples of a reopened session", _integer(1, 10_000))

    def __post_init__(self) -> None:
        _validate(self)
