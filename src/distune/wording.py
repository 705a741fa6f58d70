"""How distune words groups, throughputs and gains for people: the launcher's progress lines and
summary and the ``distune`` commands all say ``bucket 2^22 B (4 MiB), flat``, ``12.31 it/s`` and
``+4.2%`` the same way.

Every function takes what the REST API or the CSV log holds, which may be missing or malformed,
and returns ``missing`` (a table's ``-`` by default) rather than raising: a view must not crash
on a value it cannot word.
"""

from __future__ import annotations

import math
from typing import Any

from distune.space import HyperparameterError, Hyperparameters

#: The unit of a score: distune's workers report training iterations per second.
RATE_UNIT = "it/s"


def describe_hyperparameters(
    bucket_size_2p: Any, is_hierarchical_reduce: Any, missing: str = "?"
) -> str:
    """A group's knobs in words (as in the CSV log's columns)."""
    try:
        return Hyperparameters(int(bucket_size_2p), bool(is_hierarchical_reduce)).describe()
    except (HyperparameterError, TypeError, ValueError):
        return missing


def describe_group(group: Any, missing: str = "?") -> str:
    """A group of the REST API (``{"id", "hyperparameters": {...}}``) in words."""
    try:
        return Hyperparameters.from_dict(group["hyperparameters"]).describe()
    except (HyperparameterError, KeyError, TypeError):
        return missing


def _finite(value: Any) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def format_rate(value: Any, missing: str = "-") -> str:
    """A score, e.g. ``12.31 it/s``."""
    rate = _finite(value)
    return missing if rate is None else f"{rate:.4g} {RATE_UNIT}"


def format_gain(value: Any, missing: str = "-", margin: Any = None) -> str:
    """A gain over the default group, as a signed percentage, e.g. ``+4.2%``; with a finite
    ``margin`` (its interval's half-width), e.g. ``+4.2% ± 1.5%``."""
    gain = _finite(value)
    if gain is None:
        return missing
    half_width = _finite(margin)
    return f"{gain:+.1%}" if half_width is None else f"{gain:+.1%} ± {half_width:.1%}"


def counted(number: Any, noun: str, plural: str | None = None) -> str:
    """``number`` and ``noun``, plural unless ``number`` is 1: ``1 node``, ``2 nodes``, ``0 nodes``.

    ``plural`` defaults to ``noun + "s"``; a count that is not a number (``None``, ``"?"`` from
    a malformed answer) takes the plural, since it is not known to be one.
    """
    one = not isinstance(number, bool) and isinstance(number, int | float) and number == 1
    return f"{number} {noun if one else (plural or noun + 's')}"


def describe_registration(registration: Any, missing: str = "unknown facts") -> str:
    """A registration's facts (``/status``'s ``registration``) in words, e.g. ``8 ranks
    (2 nodes x 4), 1048576 gradient bytes``."""
    try:
        return (
            f"{counted(int(registration['world_size']), 'rank')} "
            f"({counted(int(registration['nnodes']), 'node')} x "
            f"{int(registration['local_world_size'])}), "
            f"{counted(int(registration['gradient_bytes']), 'gradient byte')}"
        )
    except (KeyError, TypeError, ValueError):
        return missing
