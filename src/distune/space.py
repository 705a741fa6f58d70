"""Hyperparameters and the search space, shared by the tuning service and the worker runtime.

A *group* is one point of the space: a bucket size and an allreduce shape. The space is derived
from facts about the job (the model's gradient bytes, the node topology) minus the knobs the
user fixed. This module imports neither torch nor the service so both sides can use it cheaply.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields
from typing import Any, TypeGuard

from distune.checks import InvalidValue, integer_in
from distune.errors import DistuneError

#: torch DDP's default bucket cap (25 MiB), the default group's bucket size.
DEFAULT_BUCKET_SIZE = 25 * 1024 * 1024
#: The smallest bucket the search offers (64 KiB): below it, per-message latency dominates.
MIN_TUNED_BUCKET_SIZE_2P = 16
#: Bounds on any bucket size exponent (1 byte, i.e. one bucket per parameter, to 256 TiB).
BUCKET_SIZE_2P_LIMITS = (0, 48)

#: Model names as both the service and the runtime accept them: safe in URLs, logs and CSV.
#: Not "." or "..": HTTP clients (requests, a browser's fetch) remove such a path segment, so
#: ``/api/v1/models/../register`` went to ``/api/v1/register`` and the model was never tuned.
MODEL_NAME_PATTERN = re.compile(r"(?!\.\.?$)[A-Za-z0-9._-]{1,64}")
MODEL_NAME_RULE = "1-64 characters of [A-Za-z0-9._-], other than . and .."

BUCKET_SIZE_2P = "bucket_size_2p"
IS_HIERARCHICAL_REDUCE = "is_hierarchical_reduce"
#: Names of the knobs, in the order the optimizer sees them.
KNOB_NAMES = (BUCKET_SIZE_2P, IS_HIERARCHICAL_REDUCE)


class HyperparameterError(DistuneError, ValueError):
    """A hyperparameter value, name or search-space fact is invalid; the message says why."""


def is_valid_model_name(name: object) -> TypeGuard[str]:
    """Whether ``name`` follows :data:`MODEL_NAME_RULE`."""
    return isinstance(name, str) and MODEL_NAME_PATTERN.fullmatch(name) is not None


def _check_int(name: str, value: Any, low: int, high: int) -> int:
    try:
        return integer_in(value, low, high)
    except InvalidValue as error:
        raise HyperparameterError(f"{name} {error}") from None


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise HyperparameterError(f"{name} must be a boolean (true or false), got {value!r}")
    return value


def _human_bytes(size: int) -> str:
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if size >= 1 << shift:
            return f"{size / (1 << shift):g} {unit}"
    return f"{size} B"


def bucket_size_2p_for(bucket_size: int) -> int:
    """The exponent of the power of two nearest (in log scale) to ``bucket_size`` bytes.

    Groups hold bucket sizes as powers of two (as Bagua's log does); sizes given in bytes, such
    as torch DDP's 25 MiB default, are rounded to the nearest one: 25 MiB becomes 2**25.
    """
    if isinstance(bucket_size, bool) or not isinstance(bucket_size, numbers.Integral):
        raise HyperparameterError(
            f"bucket size must be a whole number of bytes, got {bucket_size!r}"
        )
    if bucket_size <= 0:
        raise HyperparameterError(
            f"bucket size must be a positive number of bytes, got {bucket_size}"
        )
    top = BUCKET_SIZE_2P_LIMITS[1]
    if bucket_size > 1 << top:
        # The same bound, in the same words, as the launcher's --bucket_size.
        raise HyperparameterError(
            f"bucket size must be at most 2**{top} bytes ({_human_bytes(1 << top)}), "
            f"got {bucket_size}"
        )
    return round(math.log2(bucket_size))


#: The default group's bucket size exponent: 25 MiB rounds to 2**25.
DEFAULT_BUCKET_SIZE_2P = bucket_size_2p_for(DEFAULT_BUCKET_SIZE)


@dataclass(frozen=True)
class Hyperparameters:
    """One group of communication hyperparameters.

    ``bucket_size_2p`` is the log2 of the bucket size in bytes; ``is_hierarchical_reduce``
    selects intra-node reduce, inter-node allreduce among node leaders, intra-node broadcast.
    The defaults are the default group: torch DDP's 25 MiB (rounded to 2**25) and flat allreduce.
    """

    bucket_size_2p: int = DEFAULT_BUCKET_SIZE_2P
    is_hierarchical_reduce: bool = False

    def __post_init__(self) -> None:
        # Normalise integral types (numpy's included) to int, so equality and hashing are exact.
        exponent = _check_int(BUCKET_SIZE_2P, self.bucket_size_2p, *BUCKET_SIZE_2P_LIMITS)
        object.__setattr__(self, BUCKET_SIZE_2P, exponent)
        _check_bool(IS_HIERARCHICAL_REDUCE, self.is_hierarchical_reduce)

    @property
    def bucket_size(self) -> int:
        """The bucket size in bytes."""
        return 1 << self.bucket_size_2p

    def describe(self) -> str:
        """A short human form, e.g. ``bucket 2^22 B (4 MiB), flat``."""
        shape = "hierarchical" if self.is_hierarchical_reduce else "flat"
        return f"bucket 2^{self.bucket_size_2p} B ({_human_bytes(self.bucket_size)}), {shape}"

    def to_dict(self) -> dict[str, Any]:
        """The JSON form used in the REST API and the best-file."""
        return {
            BUCKET_SIZE_2P: self.bucket_size_2p,
            IS_HIERARCHICAL_REDUCE: self.is_hierarchical_reduce,
        }

    @classmethod
    def from_dict(cls, data: Any) -> Hyperparameters:
        """Parse the JSON form; every knob must be present, and nothing else."""
        if not isinstance(data, Mapping):
            raise HyperparameterError(f"hyperparameters must be an object, got {data!r}")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise HyperparameterError(
                f"unknown hyperparameter(s) {', '.join(map(repr, unknown))}; "
                f"allowed: {', '.join(KNOB_NAMES)}"
            )
        missing = [name for name in KNOB_NAMES if name not in data]
        if missing:
            raise HyperparameterError(f"missing hyperparameter(s) {', '.join(missing)}")
        return cls(**data)


@dataclass(frozen=True)
class FixedKnobs:
    """Knobs the user pinned: they keep this value and are removed from the search.

    ``None`` means the knob is tuned.
    """

    bucket_size_2p: int | None = None
    is_hierarchical_reduce: bool | None = None

    def __post_init__(self) -> None:
        if self.bucket_size_2p is not None:
            exponent = _check_int(BUCKET_SIZE_2P, self.bucket_size_2p, *BUCKET_SIZE_2P_LIMITS)
            object.__setattr__(self, BUCKET_SIZE_2P, exponent)
        if self.is_hierarchical_reduce is not None:
            _check_bool(IS_HIERARCHICAL_REDUCE, self.is_hierarchical_reduce)

    def to_dict(self) -> dict[str, Any]:
        """The pinned knobs only."""
        return {
            f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> FixedKnobs:
        """Parse ``{knob: value}``; unknown names are an error naming the allowed ones."""
        unknown = sorted(set(data) - set(KNOB_NAMES))
        if unknown:
            raise HyperparameterError(
                f"unknown hyperparameter(s) {', '.join(map(repr, unknown))}; "
                f"allowed: {', '.join(KNOB_NAMES)}"
            )
        return cls(**data)

    @classmethod
    def parse(cls, assignments: list[str]) -> FixedKnobs:
        """Parse command-line ``name=value`` pairs, e.g. ``bucket_size_2p=22``."""
        data: dict[str, Any] = {}
        for assignment in assignments:
            name, sep, text = assignment.partition("=")
            name, text = name.strip(), text.strip()
            if not sep or not name or not text:
                raise HyperparameterError(f"expected NAME=VALUE, got {assignment!r}")
            if name == IS_HIERARCHICAL_REDUCE:
                lowered = text.lower()
                if lowered not in ("true", "false", "1", "0"):
                    raise HyperparameterError(f"{name} must be true or false, got {text!r}")
                data[name] = lowered in ("true", "1")
            elif name == BUCKET_SIZE_2P:
                try:
                    data[name] = int(text)
                except ValueError:
                    raise HyperparameterError(f"{name} must be an integer, got {text!r}") from None
            else:
                data[name] = text  # rejected by from_dict with the list of allowed names
        return cls.from_dict(data)


@dataclass(frozen=True)
class ModelFacts:
    """What the search space depends on, as the leader reports it when it registers a model."""

    world_size: int
    nnodes: int
    local_world_size: int
    gradient_bytes: int

    def __post_init__(self) -> None:
        for name in ("world_size", "nnodes", "local_world_size", "gradient_bytes"):
            _check_int(name, getattr(self, name), 1, 2**62)
        if self.nnodes * self.local_world_size != self.world_size:
            raise HyperparameterError(
                f"world_size ({self.world_size}) must equal nnodes ({self.nnodes}) "
                f"x local_world_size ({self.local_world_size})"
            )

    @property
    def hierarchical_possible(self) -> bool:
        """Hierarchical allreduce differs from flat only with several nodes of several ranks."""
        return self.nnodes > 1 and self.local_world_size > 1


@dataclass(frozen=True)
class SearchSpace:
    """The groups a tuner may try for one model, and the default group it starts from.

    Build it with :meth:`for_model`. Knobs with a single possible value (fixed by the user, or
    meaningless for the topology) are not :attr:`tuned`; :meth:`complete` fills them in.
    """

    min_bucket_size_2p: int
    max_bucket_size_2p: int
    hierarchical_choices: tuple[bool, ...]
    default: Hyperparameters

    @classmethod
    def for_model(
        cls,
        facts: ModelFacts,
        fixed: FixedKnobs | None = None,
        default_bucket_size: int = DEFAULT_BUCKET_SIZE,
    ) -> SearchSpace:
        """The search space: bucket sizes from 2**16 up to the first power of two at or above
        the model's gradient bytes; hierarchical only with several multi-rank nodes.

        A fixed or default bucket size above that top is clamped to it: one bucket either way.
        """
        fixed = FixedKnobs() if fixed is None else fixed
        # A bucket at least as large as the model holds every gradient: larger ones are the same.
        top = max(MIN_TUNED_BUCKET_SIZE_2P, math.ceil(math.log2(facts.gradient_bytes)))
        if fixed.bucket_size_2p is not None:
            low = high = min(fixed.bucket_size_2p, top)
        else:
            low, high = MIN_TUNED_BUCKET_SIZE_2P, top
        if not facts.hierarchical_possible:
            hierarchical: tuple[bool, ...] = (False,)
        elif fixed.is_hierarchical_reduce is not None:
            hierarchical = (fixed.is_hierarchical_reduce,)
        else:
            hierarchical = (False, True)
        default_2p = min(max(bucket_size_2p_for(default_bucket_size), low), high)
        default_hierarchical = False if False in hierarchical else hierarchical[0]
        return cls(low, high, hierarchical, Hyperparameters(default_2p, default_hierarchical))

    def __post_init__(self) -> None:
        if self.min_bucket_size_2p > self.max_bucket_size_2p:
            raise HyperparameterError("empty bucket size range")
        if not self.hierarchical_choices:
            raise HyperparameterError("no allreduce shape to choose from")
        if self.default not in self:
            raise HyperparameterError(f"default group {self.default} is outside the space")

    @property
    def tuned(self) -> tuple[str, ...]:
        """Names of the knobs with more than one possible value, in :data:`KNOB_NAMES` order."""
        names = []
        if self.max_bucket_size_2p > self.min_bucket_size_2p:
            names.append(BUCKET_SIZE_2P)
        if len(self.hierarchical_choices) > 1:
            names.append(IS_HIERARCHICAL_REDUCE)
        return tuple(names)

    @property
    def size(self) -> int:
        """How many distinct groups the space holds."""
        buckets = self.max_bucket_size_2p - self.min_bucket_size_2p + 1
        return buckets * len(self.hierarchical_choices)

    def __contains__(self, hp: object) -> bool:
        return (
            isinstance(hp, Hyperparameters)
            and self.min_bucket_size_2p <= hp.bucket_size_2p <= self.max_bucket_size_2p
            and hp.is_hierarchical_reduce in self.hierarchical_choices
        )

    def __iter__(self) -> Iterator[Hyperparameters]:
        """Every group of the space, smallest bucket first, flat before hierarchical."""
        for exponent in range(self.min_bucket_size_2p, self.max_bucket_size_2p + 1):
            for hierarchical in self.hierarchical_choices:
                yield Hyperparameters(exponent, hierarchical)

    def point(self, hp: Hyperparameters) -> list[int | bool]:
        """The values of the tuned knobs of ``hp``, in :attr:`tuned` order."""
        if hp not in self:
            raise HyperparameterError(f"{hp} is outside the search space")
        return [getattr(hp, name) for name in self.tuned]

    def complete(self, point: list[Any]) -> Hyperparameters:
        """The group whose tuned knobs take the values of ``point``, the rest their only value."""
        if len(point) != len(self.tuned):
            raise HyperparameterError(f"expected values for {self.tuned}, got {point!r}")
        values: dict[str, Any] = {
            BUCKET_SIZE_2P: self.min_bucket_size_2p,
            IS_HIERARCHICAL_REDUCE: self.hierarchical_choices[0],
        }
        for name, value in zip(self.tuned, point, strict=True):
            # Optimizers hand back numpy scalars; keep the exact int/bool types of the group.
            if name == IS_HIERARCHICAL_REDUCE and value in (True, False):
                value = bool(value)
            values[name] = value
        hp = Hyperparameters(**values)
        if hp not in self:
            raise HyperparameterError(f"{hp} is outside the search space")
        return hp
