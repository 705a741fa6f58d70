"""``distune log LOG``: a summary of a CSV tuning log, one row per model, printed by pandas.

For each model: whether tuning completed, how many groups were sampled, the best group (the
chosen one once completed; until then the highest single sample, marked, since the log holds
no pooled score to judge by as the tuner does) with its score and gain over the default
group, the default group's score, the seconds of training the samples measured, and the
training iteration at which the choice was made. ``--samples`` adds each model's samples,
one row each. Every gain shown divides by one score, the default group's as the tuner judged
it last (the log's own ``gain_vs_default`` of a row divided by the default's score as it
stood when that row was logged, often its first sample alone), and the line above the
samples says which.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from distune.cli import path_argument
from distune.wording import counted, describe_hyperparameters, format_gain, format_rate

if TYPE_CHECKING:
    import pandas as pd

    from distune.cli.log_reader import ModelRun


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Add ``log`` to the ``distune`` command's subcommands."""
    parser = commands.add_parser(
        "log",
        help="summarize a CSV tuning log: best group, gain, samples, time spent",
        description="Summarize a tuning log (--autotune_log_file, or one copied from another "
        "machine): per model, the best group, its gain over the default group, the samples "
        "taken and the training time they measured.",
    )
    parser.add_argument("log", metavar="LOG", type=path_argument, help="the CSV tuning log")
    parser.add_argument("--samples", action="store_true", help="also list every sample")
    parser.set_defaults(run=run)


def summary(runs: list[ModelRun]) -> pd.DataFrame:
    """One row per model: the summary ``distune log`` prints."""
    import pandas as pd

    rows = []
    for run in runs:
        best = run.best
        rows.append(
            {
                "model": run.name,
                "state": _state(run),
                # Samples of the budget: a close call's legs are rows sharing their number.
                "samples": run.samples["sample"].nunique(),
                "best group": describe_hyperparameters(
                    best["bucket_size_2p"], best["is_hierarchical_reduce"]
                )
                + ("" if run.choice is not None else f" {TOP_SAMPLE_MARK}"),
                "score": format_rate(best["score"]),
                "gain vs default": format_gain(run.gain_of(best["score"])),
                "default score": format_rate(run.default_score),
                "measured": (
                    "-" if run.measured_seconds is None else f"{run.measured_seconds:.1f} s"
                ),
                "chosen at iteration": (
                    "-" if run.choice is None else str(int(run.choice["train_iter"]))
                ),
            }
        )
    return pd.DataFrame(rows)


#: Marks a best group that is the highest single sample, not a choice (:func:`top_sample_notes`).
TOP_SAMPLE_MARK = "*"


def top_sample_notes(runs: list[ModelRun]) -> list[str]:
    """What the mark on a best group says, for the kinds of run that have it: a run with no
    choice shows its highest single sample, while ``distune status``' best is the tuner's own
    pick (each group's samples pooled, groups measured twice preferred), which the log
    cannot compute: the two can name different groups until tuning completes."""
    notes = []
    if any(run.choice is None and run.source != "bagua" for run in runs):
        notes.append(
            f"{TOP_SAMPLE_MARK} not completed: the highest single sample so far; the tuner's "
            "own pick (distune status' BEST) pools each group's samples and prefers groups "
            "measured twice, so it can be another group until tuning completes"
        )
    if any(run.source == "bagua" for run in runs):
        notes.append(f"{TOP_SAMPLE_MARK} a Bagua log records no choice: the highest sample")
    return notes


def _state(run: ModelRun) -> str:
    if run.source == "bagua":
        return "Bagua log (no choice recorded)"
    if run.choice is None:
        return "not completed"
    # A drift reopened the session (distune status: sampling): the choice is the last made.
    return "reopened, re-tuning" if run.reopened else "completed"


def samples(run: ModelRun) -> pd.DataFrame:
    """One row per sample of ``run``: what ``--samples`` prints."""
    frame = run.samples
    return frame.assign(
        group=[
            describe_hyperparameters(p, h)
            for p, h in zip(frame["bucket_size_2p"], frame["is_hierarchical_reduce"], strict=True)
        ],
        score=frame["score"].map(format_rate),
        gain=frame["score"].map(lambda score: format_gain(run.gain_of(score))),
        best=run.running_best.map(format_rate),
        seconds=frame["seconds"].map(lambda s: "-" if s != s else f"{s:.2f}"),  # NaN: Bagua
    )[["sample", "phase", "group", "score", "gain", "best", "train_iter", "seconds"]].rename(
        columns={"best": "running best", "train_iter": "at iteration"}
    )


def to_text(frame: pd.DataFrame) -> str:
    """``frame`` as a text table, words aligned left and numbers right."""
    from pandas.api.types import is_numeric_dtype

    widths = {
        column: max(len(column), *(len(value) for value in frame[column]))
        for column in frame.columns
        if not is_numeric_dtype(frame[column])
    }
    # pandas right-aligns text cells (and strips padding added before); a formatter's stays.
    formatters = {column: (lambda v, w=width: v.ljust(w)) for column, width in widths.items()}
    return frame.to_string(index=False, justify="left", formatters=formatters)


def run(args: argparse.Namespace) -> int:
    """``distune log``; LogError when the file is not a readable tuning log."""
    from distune.cli.log_reader import read_log  # pandas loads for the commands that need it

    runs = read_log(args.log)
    out = sys.stdout
    # A model registered again with other facts is one run per registration, not more models.
    models = len({str(model_run.samples["model"].iloc[0]) for model_run in runs})
    heading = counted(models, "model")
    if len(runs) > models:
        heading += f", {len(runs)} registrations"
    print(f"tuning log {args.log}: {heading}", file=out)
    print(to_text(summary(runs)), file=out)
    for note in top_sample_notes(runs):
        print(note, file=out)
    if args.samples:
        for model_run in runs:
            print(f"\n{model_run.name}: {gain_base(model_run)}", file=out)
            print(to_text(samples(model_run)), file=out)
    return 0


def gain_base(run: ModelRun) -> str:
    """What every gain of ``run``'s samples divides by, in words: the default group's score
    as judged last, and whether that is its first sample alone."""
    basis = (
        "its samples after the first"
        if run.default_remeasured
        else "its first sample, the job's first after warmup: it was not measured again"
    )
    return f"gains vs the default group's {format_rate(run.default_score)} ({basis})"
