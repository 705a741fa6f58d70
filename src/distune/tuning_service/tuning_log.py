"""The CSV tuning log: one row per sampled group, plus one row for each model's final choice.

The first four columns are Bagua's, in Bagua's order (``bucket_size_2p,is_hierarchical_reduce,
score,train_iter``), so tools written for Bagua's autotune log read ours; the rest say which
model and sample a row belongs to and how it was measured. Each row is written, flushed and
fsynced as it is produced, so a killed service loses no finished sample.

Files are created safely: a default name is unpredictable and created with ``O_EXCL`` and mode
0600 (``tempfile.mkstemp``); an explicit path that is a symbolic link is refused rather than
followed.
"""

from __future__ import annotations

import csv
import io
import os
import stat
import tempfile
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path

from distune.errors import DistuneError
from distune.tuning_service.session import SampleRecord

#: The log's columns, Bagua's four first.
COLUMNS = (
    "bucket_size_2p",
    "is_hierarchical_reduce",
    "score",
    "train_iter",
    "model",
    "sample",
    "group_id",
    "phase",
    "seconds",
    "iterations",
    "windows",
    "gain_vs_default",
    "invalid_windows",
    "gain_margin",
    "ended_early",
    "note",
)
#: Default log file names: ``<dir>/distune_autotune_<random>.log``.
DEFAULT_PREFIX = "distune_autotune_"
DEFAULT_SUFFIX = ".log"


class LogFileError(DistuneError, OSError):
    """The log file cannot be created where asked; the message says why."""


def row(record: SampleRecord) -> list[str]:
    """The CSV fields of one record, in :data:`COLUMNS` order."""
    hp = record.group.hyperparameters
    return [
        str(hp.bucket_size_2p),
        str(hp.is_hierarchical_reduce),
        repr(record.score),
        str(record.train_iter),
        record.model,
        str(record.sample),
        str(record.group.id),
        record.phase.value,
        repr(record.seconds),
        str(record.iterations),
        str(record.windows),
        repr(record.gain_vs_default),
        str(record.invalid_windows),
        "" if record.gain_margin is None else repr(record.gain_margin),
        str(record.ended_early),
        record.note,
    ]


def render(records: Iterable[SampleRecord]) -> str:
    """The CSV text (header included) of ``records``, as ``/models/<name>/log`` serves it."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(COLUMNS)
    writer.writerows(row(record) for record in records)
    return buffer.getvalue()


class TuningLog:
    """An open CSV log file; :meth:`append` is thread-safe. Use :meth:`create` to open one."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._file = os.fdopen(fd, "w", newline="", encoding="utf-8")
        self._writer = csv.writer(self._file, lineterminator="\n")
        self._lock = threading.Lock()
        self._write([COLUMNS])

    @classmethod
    def create(
        cls, path: str | os.PathLike[str] | None = None, directory: str | None = None
    ) -> TuningLog:
        """Open the log at ``path`` (created or truncated; a symbolic link is refused), or at a
        new unpredictable name in ``directory`` (default: the system's temporary directory).
        """
        if path is not None:
            path = Path(path)
            # O_NONBLOCK: opening a FIFO without a reader fails instead of hanging the service.
            flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
            try:
                fd = os.open(path, flags, 0o600)
            except OSError as error:
                reason = "it is a symbolic link" if path.is_symlink() else error.strerror
                raise LogFileError(f"cannot write the tuning log to {path}: {reason}") from None
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                raise LogFileError(f"cannot write the tuning log to {path}: not a regular file")
            os.set_blocking(fd, True)
            os.ftruncate(fd, 0)
            return cls(path, fd)
        try:
            fd, name = tempfile.mkstemp(prefix=DEFAULT_PREFIX, suffix=DEFAULT_SUFFIX, dir=directory)
        except OSError as error:
            raise LogFileError(
                f"cannot create a tuning log in {directory or tempfile.gettempdir()}: "
                f"{error.strerror}"
            ) from None
        return cls(Path(name), fd)

    def append(self, records: Iterable[SampleRecord]) -> None:
        """Write ``records``, one row each, and make them durable before returning."""
        self._write([row(record) for record in records])

    def close(self) -> None:
        """Close the file."""
        with self._lock:
            self._file.close()

    def _write(self, rows: Sequence[Sequence[str]]) -> None:
        if not rows:
            return
        with self._lock:
            self._writer.writerows(rows)
            self._file.flush()
            os.fsync(self._file.fileno())
