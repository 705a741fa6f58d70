"""The launcher's view of tuning while the job runs: progress lines, and a dead service noticed.

A background thread polls the service it started (``/status``, and a model's CSV log when it
has new samples) and prints one line per event: warmup over, each sampled group with its score
and gain over the default, tuning completed. Workers print nothing of this, so the lines appear
once per job whatever the number of ranks. If the service process dies, the monitor says so
once (training goes on without it; rank 0 names the group it keeps), and stops polling.
"""

from __future__ import annotations

import contextlib
import csv
import io
import sys
import threading
from dataclasses import dataclass
from typing import Any, TextIO

from distune.launcher.service_process import TuningServiceProcess
from distune.registrations import registration_of
from distune.space import HyperparameterError, Hyperparameters
from distune.wording import (
    counted,
    describe_group,
    describe_registration,
    format_gain,
    format_rate,
)

#: Seconds between two polls of the service.
POLL_INTERVAL = 1.0


@dataclass
class _ModelProgress:
    """What has been printed about one model so far."""

    state: str = ""
    rows_seen: int = 0
    #: The samples /status counted (every registration's) when the log was last read: a
    #: close call's sample is several rows, so rows and samples are not compared.
    samples_seen: int = 0
    #: Earlier registrations with other facts seen (a model wrapped again, a job reshaped).
    earlier: int = 0


class ProgressMonitor:
    """Polls a started service and prints progress lines; call :meth:`start` and :meth:`stop`.

    With ``quiet``, progress lines are not printed; the service's death still is, since the
    user must learn that tuning stopped.
    """

    def __init__(
        self,
        service: TuningServiceProcess,
        quiet: bool = False,
        interval: float = POLL_INTERVAL,
        out: TextIO | None = None,
    ) -> None:
        self._service = service
        self._quiet = quiet
        self._interval = interval
        self._out = out
        self._models: dict[str, _ModelProgress] = {}
        self._service_gone = False
        self._last_status: dict[str, Any] | None = None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="distune-progress", daemon=True)

    @property
    def service_gone(self) -> bool:
        """Whether the service died while the job ran (reported once)."""
        return self._service_gone

    @property
    def last_status(self) -> dict[str, Any] | None:
        """The last ``/status`` the service answered, or None before the first answer."""
        return self._last_status

    def start(self) -> None:
        """Begin polling in the background."""
        self._thread.start()

    def stop(self) -> None:
        """Stop polling, after one last poll so that the final events are printed."""
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join()

    def poll(self) -> None:
        """One round: notice a dead service, else print what changed since the last round."""
        if self._service_gone:
            return
        if not self._service.alive:
            self._report_death()
            return
        status = self._service.status()
        if status is None:
            return  # busy or restarting: the next round will see
        self._last_status = status
        for name, model in sorted(status.get("models", {}).items()):
            self._update(name, model)

    def _run(self) -> None:
        while not self._stopping.wait(self._interval):
            self.poll()
        self.poll()

    def _print(self, line: str, force: bool = False) -> None:
        if force or not self._quiet:
            print(line, file=self._out or sys.stdout, flush=True)

    def _report_death(self) -> None:
        self._service_gone = True
        # A completed model's group is final, so the launcher can name it: from the last status,
        # or from the log file, which has the completed row before the job learns of it. Any
        # other model keeps the last group the service gave it, which only the job's leader
        # knows for sure (a switch may have come after the last poll): rank 0 names it.
        models = set((self._last_status or {}).get("models", {}))
        final = {
            name: describe_group((model.get("best") or {}).get("group"))
            for name, model in (self._last_status or {}).get("models", {}).items()
            if model.get("state") == "completed"
        }
        final.update(_final_groups_in_log(self._service.log_file))
        kept = [f"{name} keeps {group}" for name, group in sorted(final.items())]
        if not final or models - set(final):
            others = "any other model" if kept else "each model"
            kept.append(f"{others} keeps the last group the service gave it (rank 0 names it)")
        self._print(
            f"distune: the tuning service stopped unexpectedly (exit code "
            f"{self._service.returncode}); tuning is over, training goes on: {'; '.join(kept)}",
            force=True,
        )

    def _update(self, name: str, model: dict[str, Any]) -> None:
        progress = self._models.setdefault(name, _ModelProgress())
        state = model.get("state", "")
        earlier = model.get("earlier") or []
        if len(earlier) > progress.earlier:
            # Registered again with other facts: a new session, tuned afresh.
            progress.earlier, progress.state = len(earlier), ""
            self._print(
                f"autotune {name}: registered again with other facts "
                f"({describe_registration(model.get('registration'))}), tuning it afresh"
            )
        # The log holds every registration's rows, oldest first.
        samples = model.get("samples", 0) + sum(e.get("samples", 0) for e in earlier)
        if progress.state in ("", "warmup") and state in ("sampling", "completed"):
            self._print(
                f"autotune {name}: warmup over, sampling up to "
                f"{counted(model.get('max_samples'), 'group')}"
            )
        news = samples != progress.samples_seen or (
            state == "completed" and progress.state != "completed"
        )
        if news and self._print_new_rows(name, model, progress):
            progress.samples_seen = samples
        if state == "completed" and progress.state != "completed":
            best = model.get("best") or {}
            self._print(
                f"autotune {name}: completed, chose {describe_group(best.get('group'))} -> "
                f"{format_rate(best.get('score'))} ({format_gain(best.get('gain_vs_default'))} "
                "vs default)"
            )
        progress.state = state

    def _print_new_rows(self, name: str, model: dict[str, Any], progress: _ModelProgress) -> bool:
        """Print the log's rows not printed yet; whether the log could be read."""
        text = self._service.log(name)
        if text is None:
            return False
        rows = [row for row in csv.DictReader(io.StringIO(text)) if row.get("phase") != "completed"]
        for line in _sample_lines(name, rows, model.get("max_samples"))[progress.rows_seen :]:
            self._print(line)
        progress.rows_seen = max(progress.rows_seen, len(rows))
        return True


def _final_groups_in_log(path: str | None) -> dict[str, str]:
    """Each completed model's final group, from the ``completed`` rows of a CSV log file: of
    its latest registration only (a model registered again with other facts is tuned afresh,
    from a ``default`` sample 1 whose group id is above every earlier session's, and the job no
    longer runs the earlier choice, even one logged after the new session began)."""
    if path is None:
        return {}
    try:
        with open(path, newline="", encoding="utf-8") as file:
            rows = list(csv.DictReader(file))
    except (OSError, UnicodeDecodeError, csv.Error):
        return {}
    final: dict[str, str] = {}
    for model in dict.fromkeys(row.get("model", "") for row in rows):
        own = [row for row in rows if row.get("model", "") == model]
        numbers = registration_of(
            [(r.get("phase", ""), _int(r.get("sample")), _int(r.get("group_id"))) for r in own]
        )
        latest = max(numbers, default=0)
        for row, number in zip(own, numbers, strict=True):
            if row.get("phase") != "completed" or number != latest:
                continue
            with contextlib.suppress(KeyError, ValueError, HyperparameterError):
                hp = Hyperparameters(
                    int(row["bucket_size_2p"]), row["is_hierarchical_reduce"] == "True"
                )
                final[model] = hp.describe()
    return final


def _int(value: str | None) -> int | None:
    """A log field as an integer; None where it is missing or not one (another version)."""
    try:
        return int(value) if value else None
    except ValueError:
        return None


def _sample_lines(name: str, rows: list[dict[str, str]], max_samples: Any) -> list[str]:
    """One line per sample row of the log (earlier registrations' included, oldest first).

    A row's ``gain_vs_default`` divides by the default group's score at that moment: its
    first sample alone until it has a later one (then those, the first left out). That first
    sample is the job's first after warmup, often slowed by it, so until the default has a
    second the line says it compares with "the default's first sample"; a gain shown with its
    interval (the row's ``gain_margin``) is what the summary judges a choice by.
    """
    lines = []
    default: tuple[str | None, str | None] | None = None
    default_rows = 0
    for row in rows:
        knobs = (row.get("bucket_size_2p"), row.get("is_hierarchical_reduce"))
        if row.get("phase") == "default":  # a registration's session begins
            default, default_rows = knobs, 0
        if knobs == default:
            default_rows += 1
        if knobs == default and default_rows == 1:
            versus = None  # the default's first sample itself
        elif default_rows == 1:
            versus = "vs the default's first sample"
        else:
            versus = "vs default"
        lines.append(_sample_line(name, row, max_samples, versus))
    return lines


def _sample_line(name: str, row: dict[str, str], max_samples: Any, versus: str | None) -> str:
    """A sample row in words; ``versus`` says what its gain compares with (None: the row is
    the default group's first sample, the base of the gains)."""
    sample = f"autotune {name} sample {row.get('sample', '?')}/{max_samples}"
    try:
        hierarchical = row["is_hierarchical_reduce"] == "True"
        group = Hyperparameters(int(row["bucket_size_2p"]), hierarchical).describe()
    except (KeyError, ValueError, HyperparameterError):
        return f"{sample}: (unreadable log row)"
    rate = format_rate(row.get("score"))
    if versus is None:
        return f"{sample}: {group} -> {rate} (the default group)"
    gain = format_gain(row.get("gain_vs_default"), margin=row.get("gain_margin"))
    return f"{sample}: {group} -> {rate} ({gain} {versus})"
