"""The robust throughput of a group: a trimmed mean of its report windows' rates.

A window's rate is iterations (or samples) per second. One window can be far off for reasons
that have nothing to do with the group (a data-loader stall, a checkpoint, a timer straddling a
pause), so the score is never the last or the largest window: the lowest and highest windows
are dropped (a fifth of them at each end, at least one each once there are three) and the rest
averaged. With three windows that is the median; with five, the mean of the middle three.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence


def trimmed_count(n: int) -> int:
    """How many windows are dropped at each end of ``n`` sorted windows."""
    return max(1, n // 5) if n >= 3 else 0


def robust_throughput(rates: Sequence[float]) -> float:
    """The trimmed mean of ``rates`` (see the module's docstring); needs at least one rate."""
    if not rates:
        raise ValueError("a score needs at least one window")
    if any(not (math.isfinite(rate) and rate > 0) for rate in rates):
        raise ValueError(f"window rates must be positive and finite, got {list(rates)}")
    ordered = sorted(rates)
    k = trimmed_count(len(ordered))
    return statistics.fmean(ordered[k : len(ordered) - k])
