"""The gold star that marks the chosen configuration, drawn alike in every distune plot, so a
reader who has seen one plot finds the choice at a glance in the other."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.axes import Axes


def mark_chosen(axes: Axes, x: float, y: float, label: str) -> None:
    """Draw the chosen point at (``x``, ``y``) on ``axes``, above everything else, with ``label``
    in the legend."""
    axes.scatter(
        [x], [y], marker="*", s=260, color="gold", edgecolors="black", zorder=5, label=label
    )
