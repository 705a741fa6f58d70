"""The tuning service's state, independent of HTTP: one tuning session per model name (and per
registration of it with other facts: a model wrapped again after unfreezing layers, a job
restarted on another number of nodes; docs/tuning_service.md, "Re-registration"), the CSV log
and the best-file.

Locks: one for the table of sessions (held only to look a session up or add one), and one per
session (held while a report is accounted; a registration that replaces a session takes the
table's inside it, never the other way round, so a report checks under it that its session is
still the current one). Readers of ``/status`` and ``/hyperparameters``
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
from distune.tuning_service.session import (
    Group,
    Reply,
    SampleRecord,
    SessionView,
    State,
    TuningSession,
)
from distune.tuning_service.trial_board import TrialBoard
from distune.tuning_service.tuning_log import TuningLog
from distune.wording import counted

logger = logging.getLogger(__name__)


class UnknownModelError(DistuneError, LookupError):
    """No model of that name is registered (HTTP 404)."""


class RegistrationError(DistuneError):
    """A registration the service cannot take (HTTP 409): it holds as many sessions as it may."""


class SupersededError(DistuneError):
    """A report from a registration that a later registration of the name, with other facts,
    replaced (HTTP 409, state ``superseded``): the model that sent it is no longer tuned.

    ``group`` is that registration's last group, and ``completed`` is true, so a client that
    knows no ``superseded`` state keeps the group it runs and stops tuning."""

    def __init__(self, message: str, group: Group) -> None:
        super().__init__(message)
        self.group = group

    def to_dict(self) -> dict[str, Any]:
        """The fields of the 409's body beside ``error``."""
        return {"group": self.group.to_dict(), "state": "superseded", "completed": True}


@dataclass
class _Entry:
    """One registration of a model: its session, whose group ids start at ``first_group_id``."""

    session: TuningSession
    first_group_id: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    #: Reports that came from this registration after a later one replaced it.
    superseded_reports: int = 0


@dataclass
class _Model:
    """Every registration of one name with other facts, oldest first; the last is tuned now.

    Group ids grow across them, so a report's group id says which registration sent it."""

    entries: list[_Entry]

    @property
    def current(self) -> _Entry:
        return self.entries[-1]

    def owner(self, group_id: int) -> _Entry:
        """The registration that handed out ``group_id`` (or would have)."""
        return next(e for e in reversed(self.entries) if e.first_group_id <= group_id)


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
        self._models: dict[str, _Model] = {}
        self._lock = threading.Lock()
        self._best_lock = threading.Lock()
        #: Level 2's trials, which the service coordinates across the job's nodes.
        self.trials = TrialBoard()

    def register(self, name: str, registration: Registration) -> Reply:
        """Start tuning ``name``; resume its session if it is registered with the same facts (a
        restarted job); with other facts (a model wrapped again after unfreezing layers, a job
        restarted on another number of nodes), tune it afresh in a new session, keeping the old
        one's measurements and log rows. Raises RegistrationError past ``max_models``."""
        check_model_name(name)
        # Knobs the model pinned win over the job-wide ones.
        fixed = FixedKnobs.from_dict(
            {**self.config.fixed.to_dict(), **registration.fixed.to_dict()}
        )
        while True:
            with self._lock:
                model = self._models.get(name)
                if model is None:
                    self._check_room(name)
                    # Building the session (and its optimizer) takes milliseconds; doing it
                    # under the table lock keeps two racing first registrations from creating two.
                    session = TuningSession(name, registration.facts, fixed, self.config)
                    self._models[name] = _Model([_Entry(session)])
                    logger.info(
                        "model %s registered: %d groups to search", name, session.space.size
                    )
                    return session.view.reply
                entry = model.current
            with entry.lock:
                session = entry.session
                if session.facts == registration.facts and session.fixed == fixed:
                    logger.info("model %s registered again: resuming its session", name)
                    return session.register()
                # Held under the session's lock: no report moves its group meanwhile.
                with self._lock:
                    if model.current is entry:
                        reply = self._replace(model, registration, fixed)
                        break
            # Another registration replaced it meanwhile: compare with that one.
        if self.best_path is not None and any(
            e.session.view.state is State.COMPLETED for e in model.entries[:-1]
        ):
            # The best-file's knob keys were the replaced shape's choice: they go.
            self._write_best_file()
        return reply

    def _replace(self, model: _Model, registration: Registration, fixed: FixedKnobs) -> Reply:
        """Tune a model registered again with other facts in a new session (both locks held).

        The old measurements do not apply to another topology or gradient size. The new ids
        start above every id the old session has handed out or will: a choice pending in the
        decisions worker still moves it on by one."""
        old = model.current.session
        first = old.view.current.id + (2 if old.deciding else 1)
        self._check_room(old.name)
        session = TuningSession(old.name, registration.facts, fixed, self.config, first)
        model.entries.append(_Entry(session, first))
        logger.info(
            "model %s registered again with other facts (%s; before: %s): tuning it afresh from "
            "group %d; the earlier session's %d sample(s) stay in its log and /status's earlier",
            old.name,
            _describe(session.facts, session.fixed),
            _describe(old.facts, old.fixed),
            first,
            old.view.samples,
        )
        return session.view.reply

    def _check_room(self, name: str) -> None:
        """Refuse a new session past ``max_models`` (table lock held)."""
        sessions = sum(len(model.entries) for model in self._models.values())
        if sessions >= self.config.max_models:
            raise RegistrationError(
                f"this service tunes at most {counted(self.config.max_models, 'model')} (a model "
                f"registered again with other facts counts again); {name!r} is one too many"
            )

    def report(self, name: str, report: Report) -> Reply:
        """Account a report window of ``name``. Raises UnknownModelError, SupersededError (the
        group is an earlier registration's), StaleGroupError (the group is not current) or
        RequestError (an inconsistent window)."""
        model = self._model(name)
        while True:
            with self._lock:
                entry = model.current
                if report.group_id < entry.first_group_id:
                    raise self._superseded(model, model.owner(report.group_id), report.group_id)
            with entry.lock:
                # A registration with other facts may have replaced the session while this
                # report waited for its lock (it replaces with that lock held): judged by the
                # old session, the report would move it on to an id of the new one.
                if model.current is entry:
                    return self._account(entry, report)

    def _account(self, entry: _Entry, report: Report) -> Reply:
        """Account a report in the current registration's session (its lock held)."""
        reply, records = entry.session.report(report, decide=self._decisions is None)
        if records:
            self._record(entry.session, records)
            if entry.session.deciding:
                assert self._decisions is not None
                self._decisions.submit(self._decide, entry)
        return reply

    def _superseded(self, model: _Model, owner: _Entry, group_id: int) -> SupersededError:
        """The answer to a report from a replaced registration (table lock held). Its model is
        still training: two models may share the name, which is worth a warning, once."""
        owner.superseded_reports += 1
        old = owner.session
        # The registration that replaced it (the one with other facts; later ones may differ).
        new = model.entries[model.entries.index(owner) + 1].session
        if owner.superseded_reports == 1:
            logger.warning(
                "model %s: a report from its registration with %s came after a registration "
                "with other facts (%s) replaced it: two models may be training under this "
                "name at once (give each its own name=); the earlier one is no longer tuned",
                old.name,
                _describe(old.facts, old.fixed),
                _describe(new.facts, new.fixed),
            )
        return SupersededError(
            f"group_id: group {group_id} is of model {old.name!r} as registered with "
            f"{_describe(old.facts, old.fixed)}, since registered again with other facts "
            f"({_describe(new.facts, new.fixed)}) and tuned afresh: that registration is no "
            "longer tuned; if two models train under this name at once, give each its own name=",
            old.view.current,
        )

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
        return self._model(name).current.session.view.reply

    def views(self) -> list[SessionView]:
        """A snapshot of every model's current session."""
        with self._lock:
            entries = [model.current for model in self._models.values()]
        return [entry.session.view for entry in entries]

    def status(self) -> dict[str, Any]:
        """The ``/status`` document: each model's current session, the facts it was registered
        with, and its earlier registrations with other facts (oldest first)."""
        with self._lock:
            models = {
                name: [(e.session, e.superseded_reports) for e in model.entries]
                for name, model in self._models.items()
            }
        document = {}
        for name, sessions in models.items():
            current, _ = sessions[-1]
            document[name] = {
                **current.view.to_status(),
                "registration": _registration(current),
                "earlier": [
                    {
                        **session.view.to_status(),
                        "registration": _registration(session),
                        "superseded_reports": reports,
                    }
                    for session, reports in sessions[:-1]
                ],
            }
        return {"models": document}

    def log_csv(self, name: str) -> str:
        """The CSV log rows of ``name``, header first: every registration's, oldest first."""
        model = self._model(name)
        with self._lock:
            entries = list(model.entries)
        return tuning_log.render(
            record for entry in entries for record in entry.session.view.records
        )

    def _model(self, name: str) -> _Model:
        check_model_name(name)
        with self._lock:
            model = self._models.get(name)
        if model is None:
            raise UnknownModelError(f"model {name!r} is not registered")
        return model

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
                best_file.write_best_file(self.best_path, *self._best_views())  # type: ignore[arg-type]
            except OSError as error:
                logger.error("cannot write the best-file %s: %s", self.best_path, error)

    def _best_views(self) -> tuple[list[SessionView], bool]:
        """Per model, the session the best-file reports: the latest that completed (a model
        registered again keeps its earlier choice until the new session completes); and
        whether each is its model's latest registration, without which the file's knob keys
        would pin the next job to a choice made for another shape."""
        with self._lock:
            sessions = [[e.session for e in model.entries] for model in self._models.values()]
        views = []
        latest = True
        for registrations in sessions:
            published = [session.view for session in registrations]  # each read once
            completed = [i for i, view in enumerate(published) if view.state is State.COMPLETED]
            index = completed[-1] if completed else len(published) - 1
            views.append(published[index])
            latest = latest and index == len(published) - 1
        return views, latest


def _registration(session: TuningSession) -> dict[str, Any]:
    """The facts ``session`` was registered with, as a registration's body."""
    facts = session.facts
    return {
        "world_size": facts.world_size,
        "nnodes": facts.nnodes,
        "local_world_size": facts.local_world_size,
        "gradient_bytes": facts.gradient_bytes,
        "fixed": session.fixed.to_dict(),
    }


def _describe(facts: Any, fixed: FixedKnobs) -> str:
    return (
        f"world_size={facts.world_size}, nnodes={facts.nnodes}, "
        f"local_world_size={facts.local_world_size}, gradient_bytes={facts.gradient_bytes}, "
        f"fixed={fixed.to_dict()}"
    )
