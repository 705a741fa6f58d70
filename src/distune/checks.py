"""Range checks on setting and message values, each rule written once.

The launcher's flags, the tuning settings, the hyperparameters, the REST messages and the
workers' ``DISTUNE_*`` variables all ask the same few questions of a value: is it an integer
in a range, a finite number in a range, a positive number of seconds. Each check returns the
value (normalised to ``int`` or ``float``) or raises :class:`InvalidValue`, whose message says
what is allowed but not whose value it was: the caller adds the name and raises its own error
(``ConfigError``, ``HyperparameterError``, ``RequestError``, ...). Imports nothing heavy, so
every part may use it. docs/architecture.md says which part owns which setting.
"""

from __future__ import annotations

import contextlib
import math
import numbers
from typing import Any

from distune.errors import DistuneError


class InvalidValue(DistuneError, ValueError):
    """A value breaks its rule; the message ("must be ..., got ...") omits the value's name."""


def integer_in(value: Any, low: int, high: int) -> int:
    """``value`` as an int if it is an integer (never a bool) in [low, high]."""
    # bool is an int subclass, but `True` as a count is a bug, not a value.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidValue(f"must be an integer, got {value!r}")
    number = int(value)
    if not low <= number <= high:
        raise InvalidValue(f"must be in [{low}, {high}], got {value}")
    return number


def number_in(value: Any, low: float, high: float, *, low_open: bool = False) -> float:
    """``value`` as a float if it is a finite number (never a bool) in [low, high], or in
    (low, high] with ``low_open``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidValue(f"must be a number, got {value!r}")
    number = float(value)
    above_low = number > low if low_open else number >= low
    if not (math.isfinite(number) and above_low and number <= high):
        bracket = "(" if low_open else "["
        raise InvalidValue(f"must be in {bracket}{low:g}, {high:g}], got {value}")
    return number


def positive_seconds(value: Any) -> float:
    """A finite number of seconds above 0, from a number or its text (a flag, a variable)."""
    seconds = math.nan
    # YAML's `yes` and JSON's `true` parse to bool, which Python also treats as a number.
    if not isinstance(value, bool):
        with contextlib.suppress(ValueError, TypeError):
            seconds = float(str(value).strip())
    if not (math.isfinite(seconds) and seconds > 0):
        raise InvalidValue(f"must be a positive number of seconds, got {value!r}")
    return seconds


def whole_number_text(value: Any, low: int, high: int | None, allowed: str) -> int:
    """A whole number in [low, high] (``high`` None: no bound) from a number or its text, as a
    flag or a config file gives it; ``allowed`` words the rule for the message."""
    number = None
    if not isinstance(value, bool):
        with contextlib.suppress(ValueError):
            number = int(str(value).strip())
    if number is None or number < low or (high is not None and number > high):
        raise InvalidValue(f"must be {allowed}, got {value!r}")
    return number
