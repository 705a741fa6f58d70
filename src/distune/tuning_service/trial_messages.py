"""The level-2 trial requests the service accepts, parsed from JSON into frozen dataclasses.

Node 0's launcher publishes each trial (:class:`TrialSpec`), every node's launcher reports its
own ranks' outcome (:class:`NodeReport`), node 0 records the combined trial (its
``trials.jsonl`` record) and finally says what was chosen (:class:`TrialsFinish`); any node may
stop the trials (:class:`TrialsStop`, on Ctrl-C). Like ``messages.py``, every check names the
field at fault and what it allows, so a bad request gets a 400 that says exactly what to fix.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from distune.checks import InvalidValue, number_in
from distune.tuning_service.messages import RequestError, integer_field
from distune.tuning_service.trials.trial_result import METRICS, OUTCOMES

#: The most trials (and nodes) one tuning may have: far above any real search.
MAX_TRIAL = 100_000
MAX_NODES = 100_000
#: Error texts (traceback tails) are cut to this many characters.
MAX_ERROR_CHARS = 8_000
PURPOSE_PATTERN = re.compile(r"[a-z][a-z0-9_-]{0,31}")
#: The knobs a trial sets in every rank; None leaves the script's own value.
KNOBS = ("micro_batch", "accumulation", "stage", "checkpointing", "bf16")
MODES = ("tune", "run")


def _object(data: Any, where: str, allowed: tuple[str, ...], required: tuple[str, ...]) -> Any:
    if not isinstance(data, Mapping):
        raise RequestError(where, f"must be a JSON object, got {type(data).__name__}")
    unknown = sorted(set(data) - set(allowed))
    if unknown:
        prefix = "" if where == "body" else f"{where}."
        raise RequestError(
            f"{prefix}{unknown[0]}", f"unknown field; allowed fields are {', '.join(allowed)}"
        )
    for name in required:
        if name not in data:
            raise RequestError(name if where == "body" else f"{where}.{name}", "missing")
    return data


def _optional_object(name: str, value: Any) -> dict[str, Any] | None:
    if value is not None and not isinstance(value, Mapping):
        raise RequestError(name, f"must be a JSON object or null, got {type(value).__name__}")
    return None if value is None else dict(value)


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise RequestError(name, f"must be one of {', '.join(allowed)}, got {value!r}")
    return str(value)


def check_node_rank(node_rank: int, nnodes: int) -> int:
    """``node_rank`` if the trial's job has such a node, else RequestError saying which do."""
    if not 0 <= node_rank < nnodes:
        raise RequestError(
            "node_rank",
            f"this trial runs on {nnodes} node{'s' if nnodes > 1 else ''} "
            f"(node ranks 0 to {nnodes - 1}), got {node_rank}",
        )
    return node_rank


@dataclass(frozen=True)
class TrialKnobs:
    """What a trial sets in every rank (None: the script's own value, as in the profile)."""

    micro_batch: int | None = None
    accumulation: int | None = None
    stage: int | None = None
    checkpointing: bool | None = None
    bf16: bool | None = None

    @classmethod
    def from_json(cls, data: Any, where: str = "knobs") -> TrialKnobs:
        """Parse a ``knobs`` object; raises RequestError naming the field at fault."""
        body = _object(data, where, KNOBS, ())
        values: dict[str, Any] = {}
        for name, high in (("micro_batch", 2**31), ("accumulation", 2**31), ("stage", 3)):
            value = body.get(name)
            low = 0 if name == "stage" else 1
            values[name] = (
                None if value is None else integer_field(f"{where}.{name}", value, low, high)
            )
        for name in ("checkpointing", "bf16"):
            value = body.get(name)
            if value is not None and not isinstance(value, bool):
                raise RequestError(f"{where}.{name}", f"must be true, false or null, got {value!r}")
            values[name] = value
        return cls(**values)

    def to_json(self) -> dict[str, Any]:
        """The ``knobs`` object."""
        return {name: getattr(self, name) for name in KNOBS}


@dataclass(frozen=True)
class TrialSpec:
    """``POST /api/v1/trials``: trial ``trial`` of a job of ``nnodes`` nodes, to run with
    ``knobs`` (``config``, its DeepSpeed-keyed form, is for people), its ranks meeting at the
    rendezvous port ``master_port`` of node 0. ``job`` is node 0's job (script, arguments,
    world, cap, pins): another node started with another refuses to run its ranks."""

    trial: int
    nnodes: int
    purpose: str
    knobs: TrialKnobs
    master_port: int
    config: dict[str, Any] | None = None
    metric: str = METRICS[0]
    job: dict[str, Any] | None = None

    FIELDS = ("trial", "nnodes", "purpose", "knobs", "master_port", "config", "metric", "job")

    @classmethod
    def from_json(cls, data: Any) -> TrialSpec:
        """Parse a request body; raises RequestError naming the field at fault."""
        body = _object(data, "body", cls.FIELDS, cls.FIELDS[:5])
        purpose = body["purpose"]
        if not (isinstance(purpose, str) and PURPOSE_PATTERN.fullmatch(purpose)):
            raise RequestError(
                "purpose", f"must match {PURPOSE_PATTERN.pattern} (e.g. search), got {purpose!r}"
            )
        return cls(
            trial=integer_field("trial", body["trial"], 0, MAX_TRIAL),
            nnodes=integer_field("nnodes", body["nnodes"], 1, MAX_NODES),
            purpose=purpose,
            knobs=TrialKnobs.from_json(body["knobs"]),
            master_port=integer_field("master_port", body["master_port"], 1, 65535),
            config=_optional_object("config", body.get("config")),
            metric=_choice("metric", body.get("metric", METRICS[0]), METRICS),
            job=_optional_object("job", body.get("job")),
        )

    def to_json(self) -> dict[str, Any]:
        """The request body (and the trial's description in answers)."""
        return {
            "trial": self.trial,
            "nnodes": self.nnodes,
            "purpose": self.purpose,
            "knobs": self.knobs.to_json(),
            "master_port": self.master_port,
            "config": self.config,
            "metric": self.metric,
            "job": self.job,
        }


@dataclass(frozen=True)
class NodeReport:
    """``POST /api/v1/trials/<trial>/nodes/<node_rank>``: how the trial ended on one node.

    ``measurements`` are node 0's (its rank 0 gathers every rank's step times and peaks);
    ``peak_memory_bytes`` is the highest of this node's ranks. ``stopped`` says the node's
    launcher stopped its ranks because a peer failed or the trial was closed: its outcome is
    then a symptom, not a cause, and counts only if no node has a better explanation.
    ``failed_at`` is when the node's first failing rank failed (seconds since the epoch, its
    own clock): of two nodes that crashed, the one that failed first is the cause, its peer's
    crash in a collective with it the symptom, whichever report came first. ``diverged``: the
    node's crash is the model's parameters going NaN or inf (the search prunes its micro-batch).
    """

    outcome: str
    duration: float
    error: str | None = None
    measurements: dict[str, Any] | None = None
    peak_memory_bytes: int | None = None
    stopped: bool = False
    failed_at: float | None = None
    diverged: bool = False

    FIELDS = (
        "outcome",
        "duration",
        "error",
        "measurements",
        "peak_memory_bytes",
        "stopped",
        "failed_at",
        "diverged",
    )

    @classmethod
    def from_json(cls, data: Any) -> NodeReport:
        """Parse a request body; raises RequestError naming the field at fault."""
        body = _object(data, "body", cls.FIELDS, cls.FIELDS[:2])
        try:
            duration = number_in(body["duration"], 0.0, 1e7)
        except InvalidValue as invalid:
            raise RequestError("duration", str(invalid)) from None
        error = body.get("error")
        if error is not None and not isinstance(error, str):
            raise RequestError("error", f"must be a string or null, got {type(error).__name__}")
        peak = body.get("peak_memory_bytes")
        stopped = body.get("stopped", False)
        if not isinstance(stopped, bool):
            raise RequestError("stopped", f"must be true or false, got {stopped!r}")
        diverged = body.get("diverged", False)
        if not isinstance(diverged, bool):
            raise RequestError("diverged", f"must be true or false, got {diverged!r}")
        failed_at = body.get("failed_at")
        if failed_at is not None:
            try:
                failed_at = number_in(failed_at, 0.0, 1e11)
            except InvalidValue as invalid:
                raise RequestError("failed_at", str(invalid)) from None
        return cls(
            outcome=_choice("outcome", body["outcome"], OUTCOMES),
            duration=duration,
            error=None if error is None else error[-MAX_ERROR_CHARS:],
            measurements=_optional_object("measurements", body.get("measurements")),
            peak_memory_bytes=None
            if peak is None
            else integer_field("peak_memory_bytes", peak, 0, 2**62),
            stopped=stopped,
            failed_at=failed_at,
            diverged=diverged,
        )

    def to_json(self) -> dict[str, Any]:
        """The request body."""
        return {
            "outcome": self.outcome,
            "duration": self.duration,
            "error": self.error,
            "measurements": self.measurements,
            "peak_memory_bytes": self.peak_memory_bytes,
            "stopped": self.stopped,
            "failed_at": self.failed_at,
            "diverged": self.diverged,
        }


@dataclass(frozen=True)
class TrialRecord:
    """``POST /api/v1/trials/<trial>/record``: the trial's ``trials.jsonl`` record, as node 0
    wrote it; closes the trial."""

    record: dict[str, Any]

    @classmethod
    def from_json(cls, data: Any, trial: int) -> TrialRecord:
        """Parse a request body; the record must name ``trial`` and a known outcome."""
        if not isinstance(data, Mapping):
            raise RequestError("body", f"must be a JSON object, got {type(data).__name__}")
        body = data
        for name in ("trial", "outcome", "config"):
            if name not in body:
                raise RequestError(
                    name, "missing (a trials.jsonl record has trial, config, outcome)"
                )
        if integer_field("trial", body["trial"], 0, MAX_TRIAL) != trial:
            raise RequestError(
                "trial", f"the record is of trial {body['trial']}, posted to {trial}"
            )
        _choice("outcome", body["outcome"], OUTCOMES)
        _optional_object("config", body["config"])
        # What status and the dashboard show must have the type they expect.
        for name, high in (("throughput", 1e15), ("step_seconds", 1e7)):
            if body.get(name) is not None:
                try:
                    number_in(body[name], 0.0, high)
                except InvalidValue as error:
                    raise RequestError(name, str(error)) from None
        for name in ("peak_memory_bytes", "predicted_memory_bytes"):
            if body.get(name) is not None:
                integer_field(name, body[name], 0, 2**62)
        for name in ("purpose", "error", "strategy", "log_path"):
            if body.get(name) is not None and not isinstance(body[name], str):
                raise RequestError(name, f"must be a string or null, got {body[name]!r:.40}")
        return cls(dict(body))


@dataclass(frozen=True)
class TrialsFinish:
    """``POST /api/v1/trials/finish``: the search is over; ``chosen`` (a trial number, with its
    knobs) is what every node trains with in ``run`` mode, or None when no trial ended ok."""

    mode: str
    chosen: int | None = None
    knobs: TrialKnobs | None = None

    FIELDS = ("mode", "chosen", "knobs")

    @classmethod
    def from_json(cls, data: Any) -> TrialsFinish:
        """Parse a request body; raises RequestError naming the field at fault."""
        body = _object(data, "body", cls.FIELDS, ("mode",))
        chosen = body.get("chosen")
        knobs = body.get("knobs")
        if (chosen is None) != (knobs is None):
            raise RequestError("knobs", "give both chosen and knobs, or neither (nothing chosen)")
        return cls(
            mode=_choice("mode", body["mode"], MODES),
            chosen=None if chosen is None else integer_field("chosen", chosen, 0, MAX_TRIAL),
            knobs=None if knobs is None else TrialKnobs.from_json(knobs),
        )

    def to_json(self) -> dict[str, Any]:
        """The request body (and the ``finish`` object of answers)."""
        return {
            "mode": self.mode,
            "chosen": self.chosen,
            "knobs": None if self.knobs is None else self.knobs.to_json(),
        }


@dataclass(frozen=True)
class TrialsStop:
    """``POST /api/v1/trials/stop``: node ``node_rank`` was told to stop (a signal): every
    node stops its trial and ends."""

    node_rank: int
    reason: str

    FIELDS = ("node_rank", "reason")

    @classmethod
    def from_json(cls, data: Any) -> TrialsStop:
        """Parse a request body; raises RequestError naming the field at fault."""
        body = _object(data, "body", cls.FIELDS, cls.FIELDS)
        reason = body["reason"]
        if not (isinstance(reason, str) and 0 < len(reason) <= 200):
            raise RequestError("reason", f"must be a string of 1 to 200 characters, got {reason!r}")
        return cls(integer_field("node_rank", body["node_rank"], 0, MAX_NODES - 1), reason)
