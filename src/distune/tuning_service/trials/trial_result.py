"""What one level-2 trial produced, as ``trials.jsonl`` holds it (one object a line)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from distune.errors import DistuneError
from distune.tuning_service.trials.trial_config import TrialConfig, TrialConfigError

OK = "ok"
OOM = "oom"
TIMEOUT = "timeout"
CRASH = "crash"
INVALID = "invalid"
#: Every trial outcome, as the issue names them.
OUTCOMES = (OK, OOM, TIMEOUT, CRASH, INVALID)

THROUGHPUT = "throughput"
LATENCY = "latency"
#: ``--autotune_metric``: throughput is maximised, latency (seconds a step) minimised.
METRICS = (THROUGHPUT, LATENCY)


@dataclass(frozen=True)
class TrialResult:
    """One finished trial; measurements are None unless the trial got that far. ``steps``:
    the optimizer steps the script finished under distune (node 0's first rank), None where
    none did (it never reached distune, or failed first) or a record older than the field.
    ``diverged``: a crash because the model's parameters went NaN or inf (the search prunes the
    micro-batch, as for an out of memory, rather than give up the strategy)."""

    trial: int
    config: TrialConfig
    world_size: int
    outcome: str
    purpose: str = "search"
    throughput: float | None = None
    throughput_spread: float | None = None
    step_seconds: float | None = None
    peak_memory_bytes: int | None = None
    predicted_memory_bytes: int | None = None
    duration: float = 0.0
    log_path: str | None = None
    error: str | None = None
    batch_change: str | None = None
    facts: dict[str, Any] | None = None
    steps: int | None = None
    diverged: bool = False

    def __post_init__(self) -> None:
        if self.outcome not in OUTCOMES:
            raise ValueError(f"outcome must be one of {', '.join(OUTCOMES)}, got {self.outcome!r}")
        if self.outcome == OK and (self.throughput is None or self.step_seconds is None):
            raise ValueError("an ok trial carries its throughput and step time")

    def describe(self) -> str:
        """The configuration as progress lines and summaries say it. A profile trial that
        failed ran the script's own configuration, whose knobs distune learns only from
        measured steps: its record holds 1 for each knob no pin or mapped flag told, so it is
        not described by them."""
        if self.purpose == "profile" and self.outcome != OK:
            return "the script's own configuration (not measured)"
        return self.config.describe()

    def value(self, metric: str) -> float:
        """The metric as a number to maximise (latency is negated); only for ok trials."""
        assert self.throughput is not None and self.step_seconds is not None
        return self.throughput if metric == THROUGHPUT else -self.step_seconds

    def to_json(self) -> dict[str, Any]:
        """The ``trials.jsonl`` record."""
        return {
            "trial": self.trial,
            "purpose": self.purpose,
            "config": self.config.to_config(self.world_size),
            "strategy": self.config.strategy,
            "outcome": self.outcome,
            "throughput": self.throughput,
            "throughput_spread": self.throughput_spread,
            "step_seconds": self.step_seconds,
            "peak_memory_bytes": self.peak_memory_bytes,
            "predicted_memory_bytes": self.predicted_memory_bytes,
            "duration": round(self.duration, 3),
            "log_path": self.log_path,
            "error": self.error,
            "batch_change": self.batch_change,
            "facts": self.facts,
            "steps": self.steps,
            "diverged": self.diverged,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TrialResult:
        """The inverse of :meth:`to_json` (for ``--autotune_resume``)."""
        config = TrialConfig.from_config(data["config"])
        global_batch = data["config"]["train_batch_size"]
        per_rank = config.micro_batch * config.accumulation
        return cls(
            trial=int(data["trial"]),
            config=config,
            world_size=global_batch // per_rank,
            outcome=data["outcome"],
            purpose=data.get("purpose", "search"),
            throughput=data.get("throughput"),
            throughput_spread=data.get("throughput_spread"),
            step_seconds=data.get("step_seconds"),
            peak_memory_bytes=data.get("peak_memory_bytes"),
            predicted_memory_bytes=data.get("predicted_memory_bytes"),
            duration=float(data.get("duration", 0.0)),
            log_path=data.get("log_path"),
            error=data.get("error"),
            batch_change=data.get("batch_change"),
            facts=data.get("facts"),
            steps=data.get("steps"),
            diverged=data.get("diverged") is True,
        )


class TrialRecordError(DistuneError, ValueError):
    """A line of a ``trials.jsonl`` that holds no trial record: its number (from 1) and why
    (the JSON, type or configuration error), so each reader can word it for its own users."""

    def __init__(self, number: int, cause: Exception) -> None:
        super().__init__(f"line {number}: {cause}")
        self.number = number
        self.cause = cause


def parse_trial_lines(lines: list[str]) -> list[TrialResult]:
    """The trials of a ``trials.jsonl``'s lines, in order, blank lines skipped;
    TrialRecordError for the first line that is not a trial record (a file edited or cut
    short). ``--autotune_resume`` and ``distune plot``/``log`` both read with it."""
    results = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise TypeError(f"a JSON object, got {type(record).__name__}")
            results.append(TrialResult.from_json(record))
        except (ValueError, KeyError, TypeError, AttributeError, TrialConfigError) as error:
            raise TrialRecordError(number, error) from None
    return results
