"""What a faulted job must still get right, read from its CSV log and its output.

* lost rows: every sample the service had finished before it died (what its ``/log`` served
  just before the fault) is in the CSV file, with the same values; no row is torn;
* samples measured twice: sample numbers run 1, 2, ... without going back or a gap (a close
  call's legs share their sample's number and alternate its two groups); a group is measured
  at most once by the search (a restarted job resumes its session instead of starting the
  search again);
* the dead service reported once: one launcher notice that it died, and the group the model
  keeps named (by the leader's warning, or by the notice for a model that had completed, or by
  both when the service died between completing the model and the leader learning of it), and
  every naming must be the group it ran to the end.
"""

from __future__ import annotations

import csv
import io
import re
from collections import Counter
from itertools import pairwise
from pathlib import Path

#: The launcher's line when its tuning service dies under the job.
DEATH_NOTICE = "the tuning service stopped unexpectedly"
#: Who names the group the model keeps: the leader's warning when the service stops
#: answering, or the launcher's notice for a model it saw complete.
_KEPT = (
    re.compile(r"model 'faults' keeps training with (.+?); retrying"),
    re.compile(r"[:;] faults keeps (.+?)(?:;|$)", re.MULTILINE),
)
#: The fields that identify a row (the rest follow from them).
_IDENTITY = ("sample", "phase", "bucket_size_2p", "is_hierarchical_reduce", "score", "train_iter")


def parse_rows(text: str) -> list[dict[str, str]]:
    """The rows of a CSV log (header first)."""
    return list(csv.DictReader(io.StringIO(text)))


def sample_rows(rows: list[dict[str, str]]) -> list[dict[str, str]]:
    """The rows that are samples (not the final choice's row)."""
    return [row for row in rows if row.get("phase") != "completed"]


def torn_lines(path: Path) -> int:
    """Lines of the CSV file whose field count differs from the header's (a half-written row)."""
    lines = list(csv.reader(io.StringIO(path.read_text())))
    return sum(1 for line in lines[1:] if len(line) != len(lines[0])) if lines else 0


def lost_rows(served_before: str | None, path: Path) -> int:
    """Rows ``/log`` served before the fault that are missing from (or differ in) the file."""
    if served_before is None:
        return 0
    on_disk = {tuple(row.get(k) for k in _IDENTITY) for row in parse_rows(path.read_text())}
    return sum(
        1
        for row in parse_rows(served_before)
        if tuple(row.get(k) for k in _IDENTITY) not in on_disk
    )


def repeated_samples(rows: list[dict[str, str]]) -> list[str]:
    """What in the log shows a sample measured twice (empty when nothing does).

    A close call's sample of the budget is measured in legs that alternate its two groups,
    each leg a row with the sample's number; so a number may repeat on consecutive rows, but
    never with the same group twice in a row, and the numbers never go back."""
    samples = sample_rows(rows)
    problems = []
    numbers = [int(row["sample"]) for row in samples]
    if numbers != sorted(numbers) or sorted(set(numbers)) != list(range(1, len(set(numbers)) + 1)):
        problems.append(f"sample numbers {numbers}")
    if sum(row["phase"] == "default" for row in samples) > 1:
        problems.append("the default group sampled more than once")
    searched = Counter(_group(row) for row in samples if row["phase"] != "confirm")
    for group, count in searched.items():
        if count > 1:
            problems.append(f"group 2^{group[0]} searched {count} times")
    for before, after in pairwise(samples):
        if before["sample"] == after["sample"] and _group(before) == _group(after):
            problems.append(
                f"group 2^{after['bucket_size_2p']} measured twice in sample {after['sample']}"
            )
    return problems


def _group(row: dict[str, str]) -> tuple[str, str]:
    return (row["bucket_size_2p"], row["is_hierarchical_reduce"])


def death_notices(output: str) -> list[str]:
    """The launcher's dead-service lines."""
    return [line for line in output.splitlines() if DEATH_NOTICE in line]


def kept_groups(output: str) -> list[str]:
    """Every group the job's output says the model keeps (after its service died)."""
    return [group for pattern in _KEPT for group in pattern.findall(output)]
