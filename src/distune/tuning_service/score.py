"""The robust throughput of a group: a trimmed mean of its report windows' rates.

A window's rate is iterations (or samples) per second. One window can be far off for reasons
that have nothing to do with the group (a data-loader stall, a checkpoint, a timer straddling a
pause), so the score is never the last or the largest window: the lowest and highest windows
are dropped (a fifth of them at each end, at least one each once there are three) and the rest
averaged. With three windows that is the median; with five, the mean of the middle three.

Trimming copes with one bad window in five. A long stall (a data-loader or checkpoint pause of
several windows' worth) can hit more windows than that, so before scoring, windows far slower
than their own group's median are set aside as *stalled* (:func:`split_stalls`): a window below
a quarter of the median holds a pause at least three times as long as its work. The comparison
is within one group, never across groups, so an honestly slow group keeps all its windows.
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Iterable, Sequence
from typing import NamedTuple


class Window(NamedTuple):
    """Scored report time: ``count`` iterations (or samples, if the model counts them) and
    ``iterations`` iterations in ``seconds``, from ``reports`` reports (one, until merged)."""

    count: int
    iterations: int
    seconds: float
    reports: int = 1

    @property
    def rate(self) -> float:
        """Iterations (or samples) per second."""
        return self.count / self.seconds


def split_stalls(
    windows: Sequence[Window], reference: Iterable[float], fraction: float
) -> tuple[list[Window], list[Window]]:
    """``(valid, stalled)``: the windows whose rate is below ``fraction`` of the median of
    their group's rates (theirs and the ``reference`` rates of the group's earlier windows) are
    stalled. ``fraction`` 0 keeps every window."""
    if fraction <= 0 or not windows:
        return list(windows), []
    floor = fraction * statistics.median([*reference, *(w.rate for w in windows)])
    valid = [w for w in windows if w.rate >= floor]
    if len(valid) == len(windows):
        return valid, []
    return valid, [w for w in windows if w.rate < floor]


def bounded(windows: list[Window], limit: int) -> list[Window]:
    """``windows``, neighbours merged in pairs (their counts and seconds added) until at most
    ``limit`` remain: a long sample's memory stays bounded and all of its time still counts."""
    while len(windows) > limit:
        merged = [
            Window(
                a.count + b.count,
                a.iterations + b.iterations,
                a.seconds + b.seconds,
                a.reports + b.reports,
            )
            for a, b in zip(windows[0::2], windows[1::2], strict=False)
        ]
        windows = merged + windows[len(merged) * 2 :]
    return windows


def trimmed_count(n: int) -> int:
    """How many windows are dropped at each end of ``n`` sorted windows."""
    return max(1, n // 5) if n >= 3 else 0


@functools.cache
def trimmed_variance_factor(n: int) -> float:
    """The variance of the trimmed mean of ``n`` windows (:func:`robust_throughput`) over the
    variance of their plain mean, for normal noise: what trimming costs in precision, to be
    charged wherever a score's uncertainty is computed from the windows' noise.

    The asymptotic variance of a mean trimmed by ``g`` at each end, ``g = k / n``, over that of
    the mean: the variance of the noise winsorized at its ``g`` and ``1 - g`` quantiles over
    ``(1 - 2g)**2`` (Tukey and McLaughlin; Yuen's standard error). About 1.14 for the 20 %
    trim of many windows; 1.29 for the median of three (1.35 exactly); 1 for two or fewer.
    Memoised: a function of ``n`` alone, asked for every sample's mean at every claim.
    """
    k = trimmed_count(n)
    if k == 0:
        return 1.0
    g = k / n
    normal = statistics.NormalDist()
    c = normal.inv_cdf(1.0 - g)
    # E[X^2; |X| < c] for a standard normal, plus the 2g of mass moved to +-c.
    inner = (2.0 * normal.cdf(c) - 1.0) - 2.0 * c * normal.pdf(c)
    return (inner + 2.0 * g * c * c) / (1.0 - 2.0 * g) ** 2


def robust_throughput(rates: Sequence[float]) -> float:
    """The trimmed mean of ``rates`` (see the module's docstring); needs at least one rate."""
    if not rates:
        raise ValueError("a score needs at least one window")
    if any(not (math.isfinite(rate) and rate > 0) for rate in rates):
        raise ValueError(f"window rates must be positive and finite, got {list(rates)}")
    ordered = sorted(rates)
    k = trimmed_count(len(ordered))
    return statistics.fmean(ordered[k : len(ordered) - k])
