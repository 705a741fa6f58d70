"""``distune plot`` of a level-2 run: a figure of its trials, drawn with matplotlib.

Left, each trial's throughput in trial order, coloured by strategy and labelled with its
configuration (micro-batch x accumulation, ``c`` checkpointing, ``bf16``); a trial that did not
finish is drawn on the axis with its outcome, and the configuration level 2 chose is starred at
its mean. Right, the predicted peak memory per rank against the
measured one for every trial that has both, with the line where they agree: how well the
memory model did.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from distune.cli.chosen_marker import mark_chosen
from distune.tuning_service.trials.trial_config import STRATEGY_NAMES
from distune.tuning_service.trials.trial_result import OK, THROUGHPUT, TrialResult
from distune.tuning_service.trials.trial_search import chosen, ranking
from distune.wording import counted

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

#: One colour per strategy, in stage order.
STRATEGY_COLOURS = dict(
    zip(STRATEGY_NAMES.values(), ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728"), strict=True)
)
#: Markers of the trials that did not finish, by outcome.
OUTCOME_MARKERS = {"oom": "v", "timeout": "X", "crash": "x", "invalid": "P"}
WIDTH, HEIGHT, DPI = 13.0, 4.6, 100
MIB = 2**20


def label(trial: TrialResult) -> str:
    """The configuration, short: ``8x2``, ``8x2 c`` (checkpointing), ``8x2 bf16``; ``own``
    for a failed profile, whose record holds 1 for the knobs nothing told
    (:meth:`TrialResult.describe`)."""
    if trial.purpose == "profile" and trial.outcome != OK:
        return "own"
    config = trial.config
    text = f"{config.micro_batch}x{config.accumulation}"
    return text + (" c" if config.checkpointing else "") + (" bf16" if config.bf16 else "")


def best(trials: list[TrialResult]) -> tuple[TrialResult, float] | None:
    """The configuration level 2 chose (:func:`chosen`), its first trial and its mean
    throughput."""
    config = chosen(trials, THROUGHPUT)
    if config is None:
        return None
    mean = dict(ranking(trials, THROUGHPUT))[config]
    return next(t for t in trials if t.config == config), mean


def draw_trials(trials: list[TrialResult], title: str) -> Figure:
    """The figure of one level-2 run's ``trials``."""
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global state

    figure = Figure(figsize=(WIDTH, HEIGHT), dpi=DPI, layout="constrained")
    throughput_axes, memory_axes = figure.subplots(1, 2, width_ratios=(3, 2))
    _draw_throughput(throughput_axes, trials)
    _draw_memory(memory_axes, trials)
    figure.suptitle(title, fontsize=11)
    return figure


def _draw_throughput(axes: Axes, trials: list[TrialResult]) -> None:
    from matplotlib.ticker import MaxNLocator

    for strategy, colour in STRATEGY_COLOURS.items():
        done = [t for t in trials if t.outcome == OK and t.config.strategy == strategy]
        if done:
            axes.scatter(
                [t.trial for t in done],
                [t.throughput or 0.0 for t in done],
                color=colour,
                label=strategy,
                zorder=3,
            )
    for outcome, marker in OUTCOME_MARKERS.items():
        failed = [t for t in trials if t.outcome == outcome]
        if failed:
            axes.scatter(
                [t.trial for t in failed],
                [0.0] * len(failed),
                marker=marker,
                color=[STRATEGY_COLOURS[t.config.strategy] for t in failed],
                label=outcome,
                zorder=3,
            )
    for trial in trials:
        axes.annotate(
            label(trial),
            (trial.trial, trial.throughput or 0.0),
            textcoords="offset points",
            xytext=(0, 7),
            ha="center",
            fontsize=7,
            color="#333333",
        )
    chosen = best(trials)
    heading = counted(len(trials), "trial")
    if chosen is not None:
        trial, mean = chosen
        mark_chosen(axes, trial.trial, mean, f"best: {trial.config.describe()}")
        heading += f"; best {trial.config.describe()}, {mean:.4g} samples/s (mean)"
    axes.set_title(heading, fontsize=9)
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set_xlabel("trial")
    axes.set_ylabel("throughput (samples/s)")
    axes.grid(alpha=0.3)
    axes.margins(x=0.05, y=0.15)
    axes.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)


def _draw_memory(axes: Axes, trials: list[TrialResult]) -> None:
    # (strategy, predicted MiB, measured MiB) of every trial with both.
    points = [
        (t.config.strategy, t.predicted_memory_bytes / MIB, t.peak_memory_bytes / MIB)
        for t in trials
        if t.peak_memory_bytes and t.predicted_memory_bytes is not None
    ]
    for strategy, colour in STRATEGY_COLOURS.items():
        mine = [(p, m) for s, p, m in points if s == strategy]
        if mine:
            axes.scatter(*zip(*mine, strict=True), color=colour, label=strategy, zorder=3)
    if points:
        values = [v for _, p, m in points for v in (p, m)]
        low, high = min(values), max(values)
        axes.plot([low, high], [low, high], color="#4d4d4d", linestyle="--", linewidth=1)
        errors = [abs(p - m) / m for _, p, m in points]
        heading = (
            f"peak memory per rank, {counted(len(points), 'trial')}: prediction error\n"
            f"mean {100 * sum(errors) / len(errors):.1f} %, max {100 * max(errors):.1f} %"
        )
        axes.legend(fontsize=7, loc="upper left")
    else:
        heading = "peak memory per rank:\nno trial with both a prediction and a measurement"
    axes.set_title(heading, fontsize=9)
    axes.margins(0.1)
    axes.set_xlabel("predicted (MiB)")
    axes.set_ylabel("measured (MiB)")
    axes.grid(alpha=0.3)
