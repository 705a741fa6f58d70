"""A CSV tuning log read into pandas: one :class:`ModelRun` per model, for ``plot`` and ``log``.

The log is the service's (``--autotune_log_file``, or ``/api/v1/models/<name>/log`` saved to a
file): Bagua's four columns first, then ``model,sample,group_id,phase,seconds,iterations,
windows,gain_vs_default``; one row per sampled group and, once a model's tuning completes, one
row of phase ``completed`` holding the chosen group. Several models may share one log; a model
registered again with other facts reads as one run per registration. Nothing in it depends on
the machine that wrote it, so a copied log reads the same anywhere.

A Bagua autotune log (its four columns only, ``bucket_size_2p,is_hierarchical_reduce,score,
train_iter``) reads too, so users moving from Bagua can set its runs beside distune's: it
becomes one model named after the file, one sample per row, the first row (the group the job
started on) standing for the default group; Bagua records neither seconds nor a final choice.
"""

from __future__ import annotations

import io
import math
import os
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from distune.cli import CommandError
from distune.cut_line import parse_keeping_finished
from distune.registrations import registration_of

#: The columns the commands read, with how each is parsed; a log has these and more.
NUMERIC_COLUMNS = ("bucket_size_2p", "score", "train_iter", "sample", "seconds", "gain_vs_default")
TEXT_COLUMNS = ("is_hierarchical_reduce", "model", "phase")
#: All of them, in the log's order.
REQUIRED_COLUMNS = (
    "bucket_size_2p",
    "is_hierarchical_reduce",
    "score",
    "train_iter",
    "model",
    "sample",
    "phase",
    "seconds",
    "gain_vs_default",
)
#: The phase of a model's final row, and of its first sample (the default group).
COMPLETED = "completed"
DEFAULT = "default"
#: Bagua's autotune log columns, in its order (distune's log starts with the same four).
BAGUA_COLUMNS = ("bucket_size_2p", "is_hierarchical_reduce", "score", "train_iter")
#: The phase given to a Bagua log's rows after the first.
BAGUA_SAMPLE = "bagua"


class LogError(CommandError):
    """The file is not a readable tuning log; the message names the file and what is wrong."""


@dataclass(frozen=True)
class ModelRun:
    """One model's rows of a tuning log."""

    name: str
    #: The sampled groups, in sample order (phases default, initial, bayes, confirm).
    samples: pd.DataFrame
    #: The ``completed`` row (the chosen group), or None while tuning goes on.
    choice: pd.Series | None
    #: Which tuner wrote the log: "distune" or "bagua".
    source: str = "distune"

    @property
    def default_score(self) -> float:
        """The default group's score as the tuner judged it last, which the choice's gain
        divides by and ``distune status`` shows: its first sample alone until it was measured
        again, then its later samples only (that first sample, the job's first after warmup,
        is often slow). Implied by the last row's score and gain, each row's gain having
        divided by the default's score as it stood then."""
        last = self.choice if self.choice is not None else self.samples.iloc[-1]
        base = 1.0 + float(last["gain_vs_default"])
        return float(last["score"]) / base if base > 0 else math.nan

    @property
    def reopened(self) -> bool:
        """Whether samples were logged after the choice: the session reopened
        (``--autotune_retune_drift``: the throughput drifted below the choice's) and samples
        again, as ``distune status`` says (``sampling``, ``retunes``). The choice stays the
        last one made."""
        return self.choice is not None and bool(
            (self.samples["sample"] > self.choice["sample"]).any()
        )

    @property
    def default_remeasured(self) -> bool:
        """Whether the default group was sampled more than once (its first sample then no
        longer counts in :attr:`default_score`)."""
        first = self.samples.iloc[0]  # the default group's sample, which a session takes first
        same = (self.samples["bucket_size_2p"] == first["bucket_size_2p"]) & (
            self.samples["is_hierarchical_reduce"] == first["is_hierarchical_reduce"]
        )
        return bool(same.sum() > 1)

    def gain_of(self, score: float) -> float:
        """``score``'s gain over :attr:`default_score`: the one base for every row shown,
        rather than each row's own (the default's score when that row was logged)."""
        # Rounded: a score equal to the default's is +0.0%, not the -0.0% of a rounding error.
        return round(score / self.default_score - 1.0, 12) + 0.0

    @property
    def running_best(self) -> pd.Series:
        """The best score measured up to each sample."""
        return self.samples["score"].cummax()

    @property
    def best(self) -> pd.Series:
        """The chosen group's row once completed; until then, the highest-scoring sample."""
        if self.choice is not None:
            return self.choice
        return self.samples.loc[self.samples["score"].idxmax()]

    @property
    def measured_seconds(self) -> float | None:
        """Seconds of training measured across the samples (the job's own clock); None for a
        Bagua log, which does not record them."""
        if self.source == "bagua":
            return None
        return float(self.samples["seconds"].sum())


def read_log(path: str | os.PathLike[str]) -> list[ModelRun]:
    """The models of the tuning log at ``path``, in the order they first appear; a last
    line cut short (the job stopped while writing it) is left out, saying so."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise LogError(f"no tuning log at {path}") from None
    except IsADirectoryError:
        raise LogError(f"{path} is a directory, not a tuning log") from None
    except (OSError, UnicodeDecodeError) as error:
        reason = getattr(error, "strerror", None) or " ".join(str(error).split())
        raise LogError(f"cannot read the tuning log {path}: {reason}") from None
    return parse_keeping_finished(path, text, lambda finished: _runs(finished, path), LogError)


def _runs(text: str, path: Path) -> list[ModelRun]:
    """The models of a tuning log's ``text``; LogError naming what is wrong."""
    try:
        frame = pd.read_csv(io.StringIO(text), dtype=str, keep_default_na=False)
    except pd.errors.EmptyDataError:
        raise LogError(f"{path} is empty, not a tuning log") from None
    except pd.errors.ParserError as error:
        reason = " ".join(str(error).split())
        raise LogError(f"cannot read the tuning log {path}: {reason}") from None
    if tuple(frame.columns) == BAGUA_COLUMNS:
        return [_bagua_run(_parsed(frame, path, BAGUA_COLUMNS), path)]
    missing = [c for c in REQUIRED_COLUMNS if c not in frame.columns]
    if missing:
        columns = "columns" if len(missing) > 1 else "column"
        raise LogError(
            f"{path} is not a distune tuning log: it lacks the {columns} {', '.join(missing)} "
            f"(a distune log's header starts {','.join(REQUIRED_COLUMNS[:6])}; a Bagua log's "
            f"is {','.join(BAGUA_COLUMNS)})"
        )
    frame = _parsed(frame, path, REQUIRED_COLUMNS)
    if frame.empty:
        raise LogError(f"{path} holds no sample yet")
    runs = []
    for name in frame["model"].unique():
        registrations = _registrations(frame[frame["model"] == name])
        for number, rows in enumerate(registrations, 1):
            label = str(name)
            if len(registrations) > 1:
                label += f" (registration {number} of {len(registrations)})"
            samples = rows[rows["phase"] != COMPLETED].sort_values("sample", kind="stable")
            choices = rows[rows["phase"] == COMPLETED]
            if samples.empty:
                raise LogError(f"{path}: model {label} has a completed row but no sample")
            choice = choices.iloc[-1] if len(choices) else None
            runs.append(ModelRun(label, samples.reset_index(drop=True), choice))
    return runs


def _registrations(rows: pd.DataFrame) -> list[pd.DataFrame]:
    """A model's rows split by registration (:func:`distune.registrations.registration_of`):
    never merged, since one shape's samples say nothing of another's."""
    ids = pd.to_numeric(rows.get("group_id", pd.Series(None, index=rows.index)), errors="coerce")
    numbers = registration_of(
        [
            (phase, sample, None if pd.isna(group_id) else int(group_id))
            for phase, sample, group_id in zip(rows["phase"], rows["sample"], ids, strict=True)
        ]
    )
    return [rows[[n == k for n in numbers]] for k in sorted(set(numbers))]


def _bagua_run(frame: pd.DataFrame, path: Path) -> ModelRun:
    """A Bagua log as one model (see the module's docstring)."""
    if frame.empty:
        raise LogError(f"{path} holds no sample yet")
    first = float(frame["score"].iloc[0])
    if first <= 0:
        raise LogError(f"{path} line 2: the first score must be positive to compare with")
    samples = frame.assign(
        model=path.stem,
        sample=range(1, len(frame) + 1),
        phase=[DEFAULT] + [BAGUA_SAMPLE] * (len(frame) - 1),
        seconds=float("nan"),
        gain_vs_default=frame["score"] / first - 1.0,
    )
    return ModelRun(path.stem, samples.reset_index(drop=True), None, source="bagua")


#: Spellings of the boolean column: distune writes Python's, Bagua's tools may write 0/1.
_FLAGS = {"True": True, "False": False, "true": True, "false": False, "1": True, "0": False}


def _parsed(frame: pd.DataFrame, path: Path, columns: tuple[str, ...]) -> pd.DataFrame:
    """``frame`` with typed ``columns``; LogError naming the first bad line otherwise."""
    frame = frame.copy()
    for column in NUMERIC_COLUMNS:
        if column not in columns:
            continue
        values = pd.to_numeric(frame[column], errors="coerce")
        _check(frame, column, values.abs() < float("inf"), path)  # False for NaN too
        frame[column] = values
    flags = frame["is_hierarchical_reduce"].str.strip().map(_FLAGS)
    _check(frame, "is_hierarchical_reduce", flags.notna(), path)
    frame["is_hierarchical_reduce"] = flags.astype(bool)
    for column in ("bucket_size_2p", "train_iter", "sample"):
        if column not in columns:
            continue
        _check(frame, column, frame[column] == frame[column].round(), path)
        frame[column] = frame[column].astype("int64")
    return frame


def _check(frame: pd.DataFrame, column: str, good: pd.Series, path: Path) -> None:
    if good.all():
        return
    index = int((~good).to_numpy().nonzero()[0][0])
    line = index + 2  # the header is line 1
    raise LogError(f"{path} line {line}: bad {column} value {frame[column].iloc[index]!r}")
