"""``distune plot LOG [-o FILE.png]``: a figure of a tuning run, drawn with matplotlib.

Given a level-2 results directory (``--autotune_results_dir``) or its ``trials.jsonl``, the
figure of its trials (:mod:`distune.cli.trial_plot`). Given a CSV tuning log, one panel per
model: each sampled group's throughput against the training iteration at which
its measurement ended (marked by why it was sampled, labelled with its bucket size), the default
group's level, the running best, and the chosen group as a star once tuning completed. The
dashboard the service serves at ``/`` draws the same chart live.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from distune.cli import CommandError, path_argument
from distune.cli.chosen_marker import mark_chosen
from distune.wording import RATE_UNIT, counted, describe_hyperparameters, format_gain, format_rate

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from distune.cli.log_reader import ModelRun

#: How each phase's samples are drawn: legend label, marker, colour.
PHASE_STYLES = {
    "default": ("default group", "s", "#4d4d4d"),
    "initial": ("initial (spread over the space)", "o", "#1f77b4"),
    "bayes": ("Bayesian optimization", "o", "#ff7f0e"),
    "confirm": ("confirmation", "D", "#2ca02c"),
}
_OTHER_STYLE = ("o", "#9467bd")
#: Inches of figure: the width (the legend included), and the height of one model's panel.
WIDTH, PANEL_HEIGHT = 10.0, 3.6
DPI = 100


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Add ``plot`` to the ``distune`` command's subcommands."""
    parser = commands.add_parser(
        "plot",
        help="draw a CSV tuning log (throughput per sample, default level, best, choice) or a "
        "level-2 run's trials",
        description="Draw a tuning log (--autotune_log_file, or one copied from another "
        "machine) as a figure: each sample's throughput against the training iteration, the "
        "default group's level, the running best and the chosen group; one panel per model. "
        "Given a level-2 results directory or its trials.jsonl: each trial's throughput by "
        "configuration and strategy, and predicted against measured peak memory.",
    )
    parser.add_argument(
        "log",
        metavar="LOG",
        type=path_argument,
        help="the CSV tuning log, or a level-2 results directory or its trials.jsonl",
    )
    parser.add_argument(
        "-o",
        "--output",
        metavar="FILE",
        help="the image to write, .png (or .svg, .pdf) (default: LOG's name with .png, "
        "in the current directory)",
    )
    parser.set_defaults(run=run)


def draw(runs: list[ModelRun]) -> Figure:
    """The figure of ``runs``, one panel each, stacked."""
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global state

    figure = Figure(figsize=(WIDTH, PANEL_HEIGHT * len(runs)), dpi=DPI, layout="constrained")
    for axes, model_run in zip(
        figure.subplots(len(runs), 1, squeeze=False)[:, 0], runs, strict=True
    ):
        _draw_model(axes, model_run)
    return figure


def _group_label(bucket_size_2p: int, hierarchical: bool) -> str:
    return f"2^{bucket_size_2p}{' h' if hierarchical else ''}"


def _draw_model(axes: Axes, run: ModelRun) -> None:
    samples = run.samples
    x, y = samples["train_iter"], samples["score"]
    axes.plot(x, y, color="#c8c8c8", linewidth=1, zorder=1)
    for phase, rows in samples.groupby("phase", sort=False):
        label, marker, colour = PHASE_STYLES.get(phase, (str(phase), *_OTHER_STYLE))
        axes.scatter(
            rows["train_iter"], rows["score"], marker=marker, color=colour, label=label, zorder=3
        )
    for _, row in samples.iterrows():
        axes.annotate(
            _group_label(row["bucket_size_2p"], row["is_hierarchical_reduce"]),
            (row["train_iter"], row["score"]),
            textcoords="offset points",
            xytext=(0, 7),
            ha="center",
            fontsize=7,
            color="#333333",
        )
    axes.step(
        x, run.running_best, where="post", color="#d62728", linewidth=1.5, label="running best"
    )
    default_score = run.default_score
    axes.axhline(
        default_score,
        linestyle="--",
        color="#4d4d4d",
        linewidth=1,
        label=f"default group level ({format_rate(default_score)})",
    )
    title = f"{run.name}: {counted(len(samples), 'sample')}"
    if run.choice is not None:
        choice = run.choice
        chosen = describe_hyperparameters(
            choice["bucket_size_2p"], choice["is_hierarchical_reduce"]
        )
        gain = format_gain(choice["gain_vs_default"])
        mark_chosen(axes, choice["train_iter"], choice["score"], f"chosen: {chosen}")
        title += f", chose {chosen}: {format_rate(choice['score'])}, {gain} vs default"
        if run.reopened:  # a drift reopened it: the samples after the star are a new round
            title += "; reopened, re-tuning"
    elif run.source == "bagua":
        title += " (Bagua log: first row as the default, no choice recorded)"
    else:
        title += ", tuning not completed"
    axes.set_title(title, fontsize=10)
    axes.set_xlabel("training iteration")
    axes.set_ylabel(f"throughput ({RATE_UNIT})")
    axes.grid(alpha=0.3)
    axes.margins(x=0.05, y=0.15)
    # Outside the axes, on the right: it never hides a sample.
    axes.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)


def output_path(log: str, output: str | None) -> Path:
    """Where the image goes: ``output``, else LOG's name with ``.png`` in the current directory.
    An ``output`` without a suffix gets ``.png`` (matplotlib would add it unsaid)."""
    path = Path(output) if output else Path(Path(log).with_suffix(".png").name)
    if path.is_dir():
        raise CommandError(f"-o {output} is a directory; give the image's file name")
    if not path.suffix:
        path = path.with_name(f"{path.name}.png")
    if path.resolve() == Path(log).resolve():
        raise CommandError(f"-o {output} would overwrite the log itself")
    return path


def _figure(log: str) -> tuple[Figure, str]:
    """The figure of ``log`` and the file its default image name comes from."""
    from distune.cli.trial_log import read_trials, trials_path

    trials_file = trials_path(log)
    if trials_file is not None:
        from distune.cli.trial_plot import draw_trials

        return draw_trials(read_trials(trials_file), f"level 2: {trials_file}"), str(trials_file)
    from distune.cli.log_reader import read_log  # pandas loads for the commands that need it

    return draw(read_log(log)), log


def run(args: argparse.Namespace) -> int:
    """``distune plot``; CommandError when the log cannot be read or the image written."""
    figure, named_after = _figure(args.log)
    path = output_path(named_after, args.output)
    try:
        figure.savefig(path)
    except OSError as error:
        raise CommandError(f"cannot write {path}: {error.strerror}") from None
    except ValueError as error:  # an extension matplotlib cannot write
        raise CommandError(f"cannot write {path}: {error}") from None
    print(f"wrote {path}")
    return 0
