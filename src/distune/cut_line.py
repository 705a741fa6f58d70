"""A log whose last line was cut short: read without that line, saying so.

The service's CSV log and level 2's ``trials.jsonl`` are appended a whole line at a time, so a
complete file ends with a newline. One that does not, and whose last line cannot be read, was
cut while that line was written (the job killed, the disk full): every finished line before it
is still good, so ``distune log``, ``distune plot`` and ``distune-run --autotune_resume`` read
those and say what they left out, rather than refuse the whole file.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

Parsed = TypeVar("Parsed")


def without_cut_line(text: str) -> tuple[str, str] | None:
    """``text`` less its unfinished last line, and that line; None where ``text`` ends a
    line (or has a single line, which nothing would be left of)."""
    if not text or text.endswith("\n"):
        return None
    kept, newline, cut = text.rpartition("\n")
    return (kept + newline, cut) if newline else None


def say_cut(path: Path, line: str) -> None:
    """Tell the user (stderr) which unfinished line of ``path`` was left out."""
    shown = line if len(line) <= 60 else f"{line[:60]}..."
    print(
        f"distune: {path}: its last line is cut short ({shown!r}: the job was stopped while "
        "writing it?); read without it",
        file=sys.stderr,
    )


def parse_keeping_finished(
    path: Path,
    text: str,
    parse: Callable[[str], Parsed],
    error: type[Exception],
    say: bool = True,
) -> Parsed:
    """``parse(text)``, the file ``path``'s text; where that raises ``error`` and the last line
    is unfinished, ``parse`` of the finished lines, saying (if ``say``) which line was left
    out. A damaged finished line still raises ``error``: the parse without the cut line fails
    at the same line."""
    try:
        return parse(text)
    except error:
        cut = without_cut_line(text)
        if cut is None:
            raise
    parsed = parse(cut[0])
    if say:
        say_cut(path, cut[1])
    return parsed
