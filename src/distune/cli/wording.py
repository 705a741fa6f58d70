"""How the ``distune`` commands word groups, throughputs and gains: as the launcher's progress
lines do (``bucket 2^22 B (4 MiB), flat``, ``12.31 it/s``, ``+4.2%``)."""

from __future__ import annotations

import math
from typing import Any

from distune.space import HyperparameterError, Hyperparameters

#: The unit of a score: distune's workers report training iterations per second.
RATE_UNIT = "it/s"


def describe_hyperparameters(bucket_size_2p: Any, is_hierarchical_reduce: Any) -> str:
    """A group's knobs in words; ``?`` where they are not valid knobs."""
    try:
        return Hyperparameters(int(bucket_size_2p), bool(is_hierarchical_reduce)).describe()
    except (HyperparameterError, TypeError, ValueError):
        return "?"


def describe_group(group: Any) -> str:
    """A group of the REST API (``{"id", "hyperparameters": {...}}``) in words."""
    try:
        return Hyperparameters.from_dict(group["hyperparameters"]).describe()
    except (HyperparameterError, KeyError, TypeError):
        return "?"


def format_rate(value: Any) -> str:
    """A score, e.g. ``12.31 it/s``; ``-`` when there is none."""
    try:
        rate = float(value)
    except (TypeError, ValueError):
        return "-"
    return f"{rate:.4g} {RATE_UNIT}" if math.isfinite(rate) else "-"


def format_gain(value: Any) -> str:
    """A gain over the default group, e.g. ``+4.2%``; ``-`` when there is none."""
    try:
        gain = float(value)
    except (TypeError, ValueError):
        return "-"
    return f"{gain:+.1%}" if math.isfinite(gain) else "-"
