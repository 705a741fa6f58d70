"""A level-2 results directory's ``trials.jsonl`` read back, for ``distune plot``.

Each line is one trial's record as the launcher wrote it (:class:`TrialResult`'s JSON: its
configuration in DeepSpeed's keys, outcome, throughput, measured and predicted peak memory);
the reader ``--autotune_resume`` uses too (:func:`parse_trial_lines`) checks each. A damaged
line is named by its number.
"""

from __future__ import annotations

import json
from pathlib import Path

from distune.cli import CommandError
from distune.cut_line import parse_keeping_finished
from distune.tuning_service.trials.trial_result import (
    TrialRecordError,
    TrialResult,
    parse_trial_lines,
)

#: The file a level-2 results directory holds its trials in.
TRIALS_FILE = "trials.jsonl"


class TrialLogError(CommandError):
    """The file is not a readable ``trials.jsonl``; the message names it and what is wrong."""


def trials_path(path: str | Path) -> Path | None:
    """The ``trials.jsonl`` that ``path`` names (the file, or a results directory holding
    one), or None when ``path`` is something else (a CSV tuning log)."""
    path = Path(path)
    if path.is_dir():
        inside = path / TRIALS_FILE
        if not inside.is_file():
            raise TrialLogError(
                f"{path} is a directory without {TRIALS_FILE}: give a level-2 results directory "
                "(--autotune_results_dir), its trials.jsonl, or a CSV tuning log"
            )
        return inside
    return path if path.suffix == ".jsonl" else None


def read_trials(path: Path) -> list[TrialResult]:
    """Every trial of ``path`` (a ``trials.jsonl``), in file order."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise TrialLogError(f"cannot read {path}: {error.strerror}") from None
    except UnicodeDecodeError:
        raise TrialLogError(f"{path} is not a text file") from None
    try:
        trials = parse_keeping_finished(
            path, text, lambda finished: parse_trial_lines(finished.splitlines()), TrialRecordError
        )
    except TrialRecordError as error:
        raise _damaged(path, error) from None
    if not trials:
        raise TrialLogError(f"{path} holds no trial")
    return trials


def _damaged(path: Path, error: TrialRecordError) -> TrialLogError:
    """The error naming ``path``'s line that is not a trial record."""
    where = f"{path}, line {error.number}"
    if isinstance(error.cause, json.JSONDecodeError):
        return TrialLogError(f"{where}: not JSON ({error.cause.msg})")
    if isinstance(error.cause, KeyError):
        return TrialLogError(f"{where}: not a trial record (no {error.cause.args[0]!r})")
    return TrialLogError(f"{where}: not a trial record: {error.cause}")
