"""The tuning service's state, independent of HTTP: one tuning session per model name, the CSV
log and the best-file.

Locks: one for the table of sessions (held only to look a session up or add one), and one per
session (held while a report is accounted). Readers of ``/status`` and ``/hyperparameters``
take each session's published snapshot and wait on neither, so they answer in microseconds
whatever the sessions are doing.

Choosing the next group after a finished sample may fit the Gaussian process (tens of
milliseconds). Given an executor (``decisions``; the server gives it one worker thread), the
service does that off the request path: the report that finished the sample is answered at
once with the current group, and the worker publishes the next one when it is chosen (the job
learns it from its next poll, or from the 409 of its next report). Without one, the report
that finishes a sample waits for the choice, which keeps tests simple.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Executor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distune.errors import DistuneError
from distune.space import FixedKnobs
from distune.tuning_service import best_file, tuning_log
from distune.tuning_service.config import TuningConfig
from distune.tuning_service.messages import Registration, Report, check_model_name
from distune.tuning_service.session import Reply, SampleRecord, SessionView, TuningSession
from distune.tuning_service.trial_board import TrialBoard
from distune.tuning_service.tuning_log import TuningLog

logger = logging.getLogger(__name__)


class UnknownModelError(DistuneError, LookupError):
    """No model of that name is registered (HTTP 404)."""


class RegistrationError(DistuneError):
    """A registration conflicts with the service's state (HTTP 409): the model is registered
    with other facts, or the service tracks as many models as it may."""


@dataclass
class _Entry:
    session: TuningSession
    lock: threading.Lock = field(default_factory=threading.Lock)


class TuningService:
    """The sessions of every model a job tunes; thread-safe."""

    def __init__(
        self,
        config: TuningConfig | None = None,
        log: TuningLog | None = None,
        best_path: Path | None = None,
        decisions: Executor | None = None,
    ) -> None:
        self.config = TuningConfig() if config is None else config
        self.log = log
        self.best_path = best_path
        self._decisions = decisions
        self._entries: dict[str, _Entry] = {}
        self._lock = threading.Lock()
        self._best_lock = threading.Lock()
        #: Level 2's trials, which the service coordinates across the job's nodes.
        self.trials = TrialBoard()

    def register(self, name: str, registration: Registration) -> Reply:
        """Start tuning ``name``, or resume its session if it is registered with the same facts
        (a restarted job). Raises RegistrationError otherwise."""
        check_model_name(name)
        # Knobs the model pinned win over the job-wide ones.
        fixed = FixedKnobs.from_dict(
            {**self.config.fixed.to_dict(), **registration.fixed.to_dict()}
        )
        with self._lock:
            entry = self._entries.get(name)
            if entry is None:
                if len(self._entries) >= self.config.max_models:
                    raise RegistrationError(
                        f"this service tunes at most {self.config.max_models} models; "
                        f"{name!r} is one too many"
                    )
                # Building the session (and its optimizer) takes milliseconds; doing it under
                # the table lock keeps two racing first registrations from creating two.
                session = TuningSession(name, registration.facts, fixed, self.config)
                self._entries[name] = _Entry(session)
                logger.info("model %s registered: %d groups to search", name, session.space.size)
                return session.view.reply
        with entry.lock:
            session = entry.session
            if session.facts != registration.facts or session.fixed != fixed:
                raise RegistrationError(
                    f"model {name!r} is already registered with other facts "
                    f"({_describe(session.facts, session.fixed)}); "
                    f"got {_describe(registration.facts, fixed)}"
                )
            logger.info("model %s registered again: resuming its session", name)
            return session.register()

    def report(self, name: str, report: Report) -> Reply:
        """Account a report window of ``name``. Raises UnknownModelError, StaleGroupError (the
        group is not current) or RequestError (an inconsistent window)."""
        entry = self._entry(name)
        with entry.lock:
            reply, records = entry.session.report(report, decide=self._decisions is None)
            if records:
                self._record(entry.session, records)
                if entry.session.deciding:
                    assert self._decisions is not None
                    self._decisions.submit(self._decide, entry)
        return reply

    def _decide(self, entry: _Entry) -> None:
        """Choose and apply a session's next group (in the decisions executor)."""
        session = entry.session
        try:
            # Outside the lock: reports are answered meanwhile, and touch nothing it reads.
            choice = session.choose_next()
            with entry.lock:
                records = session.apply(choice)
                if records:
                    self._record(session, records)
        except Exception:
            # A bug, not bad input; the job keeps the group it has.
            logger.exception("model %s: choosing the next group failed", session.name)

    def hyperparameters(self, name: str) -> Reply:
        """The group ``name`` should run now."""
        return self._entry(name).session.view.reply

    def views(self) -> list[SessionView]:
        """A snapshot of every session."""
        with self._lock:
            entries = list(self._entries.values())
        return [entry.session.view for entry in entries]

    def status(self) -> dict[str, Any]:
        """The ``/status`` document."""
        return {"models": {view.name: view.to_status() for view in self.views()}}

    def log_csv(self, name: str) -> str:
        """The CSV log rows of ``name``, header first."""
        return tuning_log.render(self._entry(name).session.view.records)

    def _entry(self, name: str) -> _Entry:
        check_model_name(name)
        with self._lock:
            entry = self._entries.get(name)
        if entry is None:
            raise UnknownModelError(f"model {name!r} is not registered")
        return entry

    def _record(self, session: TuningSession, records: list[SampleRecord]) -> None:
        for record in records:
            hp = record.group.hyperparameters
            logger.info(
                "model %s sample %d (%s) %s: %.4g/s (%+.1f%% vs default)",
                record.model,
                record.sample,
                record.phase.value,
                hp.describe(),
                record.score,
                100 * record.gain_vs_default,
            )
        for record in records:
            if record.note:
                logger.info("model %s: %s", record.model, record.note)
        if self.log is not None:
            try:
                self.log.append(records)
            except OSError as error:
                # A full disk must not take tuning down with it; the rows stay in /log.
                logger.error("cannot append to the tuning log %s: %s", self.log.path, error)
        if session.view.reply.completed and self.best_path is not None:
            self._write_best_file()

    def _write_best_file(self) -> None:
        with self._best_lock:
            try:
                best_file.write_best_file(self.best_path, self.views())  # type: ignore[arg-type]
            except OSError as error:
                logger.error("cannot write the best-file %s: %s", self.best_path, error)


def _describe(facts: Any, fixed: FixedKnobs) -> str:
    return (
        f"world_size={facts.world_size}, nnodes={facts.nnodes}, "
        f"local_world_size={facts.local_world_size}, gradient_bytes={facts.gradient_bytes}, "
        f"fixed={fixed.to_dict()}"
    )
