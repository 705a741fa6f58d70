"""The requests the service accepts, parsed from JSON into frozen dataclasses.

Every check names the field at fault and what it allows, so a bad request gets a 4xx that says
exactly what to fix. Numbers must be JSON numbers of the right kind: ``true`` is not an integer,
``4.0`` is not an iteration count, and NaN, infinities and absurd magnitudes are refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from distune.checks import InvalidValue, integer_in, number_in
from distune.errors import DistuneError
from distune.space import (
    MODEL_NAME_RULE,
    FixedKnobs,
    HyperparameterError,
    ModelFacts,
    is_valid_model_name,
)

#: Model names: 1 to 64 letters, digits, dots, underscores or dashes.
#: The largest integer a report may carry: JSON numbers above it lose precision in most clients.
MAX_COUNT = 2**53
#: A report window lasts at least a microsecond and at most about eleven days.
SECONDS_RANGE = (1e-6, 1e6)
#: No training does a billion iterations (or samples) a second: a window claiming more is a
#: measurement bug, and its score would dwarf every honest one.
MAX_RATE = 1e9


class RequestError(DistuneError, ValueError):
    """A request is malformed; ``field`` names the culprit (``body`` for the whole of it)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def check_model_name(name: str) -> str:
    """Return ``name`` if it is a valid model name, else raise RequestError."""
    if not is_valid_model_name(name):
        raise RequestError("name", f"model names are {MODEL_NAME_RULE}, got {name[:80]!r}")
    return name


def _object(data: Any, allowed: tuple[str, ...], required: tuple[str, ...]) -> Mapping[str, Any]:
    if not isinstance(data, Mapping):
        raise RequestError("body", f"must be a JSON object, got {type(data).__name__}")
    unknown = sorted(set(data) - set(allowed))
    if unknown:
        raise RequestError(unknown[0], f"unknown field; allowed fields are {', '.join(allowed)}")
    for name in required:
        if name not in data:
            raise RequestError(name, "missing required field")
    return data


def integer_field(name: str, value: Any, low: int, high: int) -> int:
    """``value`` as an integer in [``low``, ``high``], or a RequestError naming field ``name``
    (shared by every message of the REST API, so a count is checked one way)."""
    try:
        return integer_in(value, low, high)
    except InvalidValue as error:
        raise RequestError(name, str(error)) from None


def _seconds(name: str, value: Any) -> float:
    try:
        return number_in(value, *SECONDS_RANGE)
    except InvalidValue as error:
        raise RequestError(name, str(error)) from None


@dataclass(frozen=True)
class Registration:
    """``POST .../register``: the facts the search space depends on, and the knobs the model's
    constructor pinned (merged over the service's job-wide fixed knobs)."""

    facts: ModelFacts
    fixed: FixedKnobs = field(default_factory=FixedKnobs)

    FIELDS = ("world_size", "nnodes", "local_world_size", "gradient_bytes", "fixed")

    @classmethod
    def from_json(cls, data: Any) -> Registration:
        """Parse a request body; raises RequestError naming the field at fault."""
        body = _object(data, cls.FIELDS, cls.FIELDS[:4])
        counts = {name: integer_field(name, body[name], 1, 2**62) for name in cls.FIELDS[:3]}
        # A bucket holds at most 2**48 bytes (Hyperparameters' limit), so must the model.
        counts["gradient_bytes"] = integer_field("gradient_bytes", body["gradient_bytes"], 1, 2**48)
        try:
            facts = ModelFacts(**counts)
        except HyperparameterError as error:
            raise RequestError("world_size", str(error)) from None
        fixed = body.get("fixed", {})
        if not isinstance(fixed, Mapping):
            raise RequestError("fixed", f"must be an object of knob values, got {fixed!r}")
        for knob, value in fixed.items():
            if value is None:  # FixedKnobs reads None as "tuned"; a request says so by omission
                raise RequestError(f"fixed.{knob}", "must be a value; omit a knob to tune it")
        try:
            return cls(facts, FixedKnobs.from_dict(fixed))
        except HyperparameterError as error:
            raise RequestError("fixed", str(error)) from None


@dataclass(frozen=True)
class Report:
    """``POST .../report``: ``iterations`` training iterations (``samples`` samples, if given)
    done under group ``group_id`` in ``seconds`` (the slowest rank's), ending at iteration
    ``train_iter``. Constructing one validates it (RequestError names the field at fault)."""

    group_id: int
    train_iter: int
    iterations: int
    seconds: float
    samples: int | None = None

    FIELDS = ("group_id", "train_iter", "iterations", "seconds", "samples")

    def __post_init__(self) -> None:
        integer_field("group_id", self.group_id, 0, MAX_COUNT)
        integer_field("train_iter", self.train_iter, 0, MAX_COUNT)
        integer_field("iterations", self.iterations, 1, MAX_COUNT)
        object.__setattr__(self, "seconds", _seconds("seconds", self.seconds))
        if self.samples is not None:
            integer_field("samples", self.samples, 1, MAX_COUNT)
        if self.rate > MAX_RATE:
            field = "iterations" if self.samples is None else "samples"
            raise RequestError(
                field,
                f"{field} / seconds must be at most {MAX_RATE:g} per second, got "
                f"{self.rate:.4g} ({field} {getattr(self, field)} in {self.seconds:g} s)",
            )

    @property
    def rate(self) -> float:
        """The window's throughput: samples per second if it counts samples, else iterations."""
        return (self.iterations if self.samples is None else self.samples) / self.seconds

    @classmethod
    def from_json(cls, data: Any) -> Report:
        """Parse a request body; raises RequestError naming the field at fault."""
        body = _object(data, cls.FIELDS, cls.FIELDS[:4])
        if "samples" in body and body["samples"] is None:
            raise RequestError("samples", "must be an integer; omit it to count iterations")
        return cls(**body)
