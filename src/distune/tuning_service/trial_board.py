"""Level-2 trials as the service coordinates them across the job's nodes.

Node 0's launcher runs the search (``tuning_service.trials``) and publishes each trial here;
every node's launcher (node 0's included) polls for the current trial, runs its own ranks of it
as a real job meeting at the published rendezvous port, and reports its node's outcome; node 0
reads the combined outcome, records the trial (its ``trials.jsonl`` record, which ``distune
status`` and the dashboard show) and publishes the next. At the end node 0 says what was chosen
(every node then trains with it in ``run`` mode); a stop from any node (Ctrl-C) ends the trials
on every node.

The board is passive: it keeps no clock. Deciding that a node is late (it never reported within
the trial time-out) is node 0's, which then records the trial as ``timeout``.

States of the board: ``waiting`` (no trial yet), ``tuning``, ``finished``, ``stopped``.
States of a trial: ``running`` (some node has not reported), ``reported`` (every node has),
``recorded`` (node 0 closed it with its record; late reports are refused).
"""

from __future__ import annotations

import math
import threading
from dataclasses import asdict, dataclass, field
from typing import Any

from distune.errors import DistuneError
from distune.tuning_service.trial_messages import (
    MAX_NODES,
    NodeReport,
    TrialRecord,
    TrialsFinish,
    TrialSpec,
    TrialsStop,
    check_node_rank,
)
from distune.tuning_service.trials.trial_result import (
    CRASH,
    INVALID,
    LATENCY,
    OK,
    OOM,
    THROUGHPUT,
    TIMEOUT,
)
from distune.wording import counted

WAITING = "waiting"
TUNING = "tuning"
FINISHED = "finished"
STOPPED = "stopped"
#: The board's states, in the order they happen.
BOARD_STATES = (WAITING, TUNING, FINISHED, STOPPED)
RUNNING = "running"
REPORTED = "reported"
RECORDED = "recorded"
#: A trial's states, in the order they happen.
TRIAL_STATES = (RUNNING, REPORTED, RECORDED)
#: Which node's outcome explains the trial's: the first of these any node reported. An out of
#: memory makes the peers fail in their collectives, and a hung node makes them time out, so
#: those are causes; a crash is next; a node that ended without measuring makes the trial
#: invalid; only when every node is ok is the trial ok.
OUTCOME_PRIORITY = (OOM, TIMEOUT, CRASH, INVALID, OK)


class UnknownTrialError(DistuneError, LookupError):
    """No trial of that number was published (HTTP 404)."""


class TrialConflictError(DistuneError):
    """A trial request conflicts with the board's state (HTTP 409): e.g. a new trial while one
    runs, a second different report of a node, a late report of a recorded trial."""


@dataclass
class _Trial:
    spec: TrialSpec | None  # None: a trial recorded without running (resumed)
    reports: dict[int, NodeReport] = field(default_factory=dict)  # in the order they came
    record: dict[str, Any] | None = None

    @property
    def number(self) -> int:
        assert self.spec is not None or self.record is not None
        return self.spec.trial if self.spec is not None else int(self.record["trial"])  # type: ignore[index]

    @property
    def state(self) -> str:
        if self.record is not None:
            return RECORDED
        assert self.spec is not None
        return REPORTED if len(self.reports) == self.spec.nnodes else RUNNING

    def missing(self) -> list[int]:
        if self.spec is None:
            return []
        return [node for node in range(self.spec.nnodes) if node not in self.reports]

    def failed(self) -> bool:
        """Whether a node reported a failure of its own (not a stop caused by a peer)."""
        return any(r.outcome != OK and not r.stopped for r in self.reports.values())

    def combined(self) -> dict[str, Any] | None:
        """The trial's outcome from its nodes' reports; None until every node reported."""
        if self.state == RUNNING or not self.reports:
            return None
        causes = [(n, r) for n, r in self.reports.items() if not r.stopped] or list(
            self.reports.items()
        )
        outcome = min((r.outcome for _, r in causes), key=OUTCOME_PRIORITY.index)
        # Of the nodes with that outcome, the one that failed first (its own clock; a report
        # without a time counts last), else the first to report: a rank that raised on node 1
        # makes node 0's ranks crash in their collective with it, and node 0 may report first.
        node, first = min(
            ((n, r) for n, r in causes if r.outcome == outcome),
            key=lambda item: math.inf if item[1].failed_at is None else item[1].failed_at,
        )
        peaks = [r.peak_memory_bytes for r in self.reports.values() if r.peak_memory_bytes]
        measured = next((r.measurements for r in self.reports.values() if r.measurements), None)
        multi_node = self.spec is not None and self.spec.nnodes > 1
        error = first.error
        if error is not None and multi_node:
            error = f"node {node}: {error}"
        return {
            "outcome": outcome,
            "error": error,
            "node": node,
            "measurements": measured if outcome == OK else None,
            "peak_memory_bytes": max(peaks) if peaks else None,
            "duration": max(r.duration for r in self.reports.values()),
            "diverged": outcome == CRASH and first.diverged,
        }

    def view(self) -> dict[str, Any]:
        return {
            "trial": self.number,
            "state": self.state,
            "spec": None if self.spec is None else self.spec.to_json(),
            "nodes": {str(n): r.to_json() for n, r in self.reports.items()},
            "missing": self.missing(),
            "failed": self.failed(),
            "combined": self.combined(),
            "record": self.record,
        }


class TrialBoard:
    """The trials of one level-2 tuning; thread-safe (one lock, held microseconds)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._trials: dict[int, _Trial] = {}
        self._nnodes: int | None = None
        self._metric = THROUGHPUT
        self._finish: TrialsFinish | None = None
        self._stop: TrialsStop | None = None
        # Nodes that have seen the finish or the stop: node 0 keeps its service until all have.
        self._acknowledged: set[int] = set()

    def _state(self) -> str:
        if self._stop is not None:
            return STOPPED
        if self._finish is not None:
            return FINISHED
        return TUNING if self._trials else WAITING

    def _latest(self) -> _Trial | None:
        return self._trials[max(self._trials)] if self._trials else None

    def _check_open(self, what: str) -> None:
        state = self._state()
        if state in (FINISHED, STOPPED):
            raise TrialConflictError(f"the trials are {state}; {what} is no longer possible")

    def _get(self, number: int) -> _Trial:
        trial = self._trials.get(number)
        if trial is None:
            known = f"there are trials 0 to {max(self._trials)}" if self._trials else "none was yet"
            raise UnknownTrialError(f"no trial {number} was published; {known}")
        return trial

    def _check_next(self, number: int, what: str) -> None:
        latest = self._latest()
        if latest is None:
            return
        if latest.state != RECORDED:
            raise TrialConflictError(
                f"{what}: trial {latest.number} is still {latest.state} (nodes "
                f"{latest.missing() or 'all'} to report); node 0 records it first"
            )
        if number <= latest.number:
            raise TrialConflictError(
                f"{what}: trial numbers grow; the next must be above {latest.number}, got {number}"
            )

    def publish(self, spec: TrialSpec) -> dict[str, Any]:
        """Open trial ``spec.trial`` (node 0); idempotent for the same spec."""
        with self._lock:
            existing = self._trials.get(spec.trial)
            if existing is not None and existing.spec == spec:
                return existing.view()  # a retried request
            self._check_open(f"publishing trial {spec.trial}")
            if self._nnodes is not None and spec.nnodes != self._nnodes:
                raise TrialConflictError(
                    f"nnodes: this tuning's trials run on {counted(self._nnodes, 'node')}, "
                    f"got {spec.nnodes}"
                )
            self._check_next(spec.trial, f"publishing trial {spec.trial}")
            self._nnodes, self._metric = spec.nnodes, spec.metric
            trial = self._trials[spec.trial] = _Trial(spec)
            return trial.view()

    def report(self, number: int, node_rank: int, report: NodeReport) -> dict[str, Any]:
        """Take node ``node_rank``'s outcome of trial ``number``; idempotent for the same."""
        with self._lock:
            trial = self._get(number)
            if trial.spec is None:
                raise TrialConflictError(
                    f"trial {number} was reused from an earlier tuning; no node runs it"
                )
            check_node_rank(node_rank, trial.spec.nnodes)
            earlier = trial.reports.get(node_rank)
            if earlier == report:
                return trial.view()
            if earlier is not None:
                raise TrialConflictError(
                    f"node {node_rank} reported trial {number} already (outcome {earlier.outcome})"
                )
            if trial.record is not None:
                raise TrialConflictError(
                    f"trial {number} is recorded already (outcome {trial.record['outcome']}); "
                    f"node {node_rank}'s report came too late"
                )
            trial.reports[node_rank] = report
            return trial.view()

    def record(self, number: int, record: TrialRecord) -> dict[str, Any]:
        """Close trial ``number`` with its record (node 0). A number above every published one
        records a trial reused from an earlier tuning (``--autotune_resume``)."""
        with self._lock:
            trial = self._trials.get(number)
            if trial is None:
                self._check_open(f"recording trial {number}")
                self._check_next(number, f"recording trial {number}")
                trial = self._trials[number] = _Trial(None)
            elif trial.record is not None:
                if trial.record == record.record:
                    return trial.view()
                raise TrialConflictError(f"trial {number} is recorded already")
            trial.record = record.record
            return trial.view()

    def trial(self, number: int) -> dict[str, Any]:
        """Trial ``number``'s state, node reports, combined outcome and record."""
        with self._lock:
            return self._get(number).view()

    def current(self, node_rank: int | None = None) -> dict[str, Any]:
        """What a node's launcher needs to know now: the board's state, the latest trial, and
        the finish or stop once there is one. Asked by ``node_rank`` once finished or stopped,
        it notes that node has seen the end (``acknowledged``)."""
        with self._lock:
            state = self._state()
            if node_rank is not None:
                check_node_rank(node_rank, self._nnodes or MAX_NODES)
                if state in (FINISHED, STOPPED):
                    self._acknowledged.add(node_rank)
            latest = self._latest()
            return {
                "state": state,
                "trial": None if latest is None else latest.view(),
                "finish": None if self._finish is None else self._finish.to_json(),
                "stop": None if self._stop is None else asdict(self._stop),
                "acknowledged": sorted(self._acknowledged),
            }

    def finish(self, finish: TrialsFinish) -> dict[str, Any]:
        """End the search with its choice (node 0); idempotent for the same."""
        with self._lock:
            if self._finish == finish:
                return self._overview()
            self._check_open("finishing")
            latest = self._latest()
            if latest is not None and latest.state != RECORDED:
                raise TrialConflictError(
                    f"trial {latest.number} is still {latest.state}; node 0 records it first"
                )
            if finish.chosen is not None:
                chosen = self._get(finish.chosen)
                outcome = None if chosen.record is None else chosen.record.get("outcome")
                if outcome != OK:
                    raise TrialConflictError(
                        f"chosen: trial {finish.chosen} ended {outcome}; only an ok trial "
                        "can be chosen"
                    )
            self._finish = finish
            return self._overview()

    def stop(self, stop: TrialsStop) -> dict[str, Any]:
        """Stop the trials on every node; the first stop's reason is kept."""
        with self._lock:
            if self._stop is None and self._finish is None:
                if self._nnodes is not None:
                    check_node_rank(stop.node_rank, self._nnodes)
                self._stop = stop
            if self._stop is not None:
                self._acknowledged.add(stop.node_rank)  # the stopping node knows
            return self._overview()

    def overview(self) -> dict[str, Any]:
        """``GET /api/v1/trials``: every recorded trial's record, and which is best."""
        with self._lock:
            return self._overview()

    def _best(self, records: list[dict[str, Any]]) -> int | None:
        if self._finish is not None:
            return self._finish.chosen
        scored = [r for r in records if r.get("outcome") == OK and r.get(_KEY[self._metric])]
        if not scored:
            return None
        sign = 1.0 if self._metric == THROUGHPUT else -1.0
        return int(max(scored, key=lambda r: sign * float(r[_KEY[self._metric]]))["trial"])

    def _overview(self) -> dict[str, Any]:
        records = [t.record for _, t in sorted(self._trials.items()) if t.record is not None]
        latest = self._latest()
        running = latest is not None and latest.state != RECORDED
        return {
            "state": self._state(),
            "nnodes": self._nnodes,
            "metric": self._metric,
            "running": latest.view() if running and latest is not None else None,
            "best": self._best(records),
            "finish": None if self._finish is None else self._finish.to_json(),
            "stop": None if self._stop is None else asdict(self._stop),
            "trials": records,
        }


#: The record field each metric is judged by.
_KEY = {THROUGHPUT: "throughput", LATENCY: "step_seconds"}
