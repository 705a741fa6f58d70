"""This node's part of a level-2 trial: run its ranks as the service published the trial,
stop them early when the service says so, and report the node's outcome.

Every node's launcher (node 0's included) runs each trial through :class:`NodeTrials`. While
the ranks run, it asks the service twice a second whether the trial goes on: a peer node that
failed on its own (its rank crashed, ran out of memory, or hung), a trial node 0 closed (it gave
up waiting), a stop from any node (Ctrl-C) or a service that stays unreachable all stop this
node's ranks at once, so no node waits out its watchdog for a job that cannot finish.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

from distune.errors import DistuneError, ServiceError
from distune.launcher.trial_args import rewrite_script_args
from distune.launcher.trial_client import TrialClient, TrialRefusedError
from distune.launcher.trial_runner import TrialRun, TrialRunner
from distune.trial_settings import TrialSettings
from distune.tuning_service.trial_board import RECORDED, STOPPED
from distune.tuning_service.trial_messages import TrialKnobs
from distune.tuning_service.trials.trial_config import TrialPins
from distune.tuning_service.trials.trial_result import OK

#: Seconds the service may stay unreachable while a trial runs before this node stops it.
SERVICE_LOST_AFTER = 15.0


class TrialsStoppedError(DistuneError):
    """A node (this one or a peer) stopped the trials, or the service is gone; the message
    says which."""


def settings_from_knobs(knobs: TrialKnobs, device_memory: int | None) -> TrialSettings:
    """The ranks' settings for published knobs, with this node's memory cap."""
    return TrialSettings(
        knobs.micro_batch,
        knobs.accumulation,
        knobs.stage,
        knobs.checkpointing,
        device_memory,
        bf16=knobs.bf16,
    )


def stop_reason(current: dict[str, Any], trial: int, node_rank: int) -> str | None:
    """Why this node should stop its ranks of ``trial``, from ``GET /trials/current``; None
    to go on."""
    if current.get("state") == STOPPED:
        stop = current.get("stop") or {}
        return f"node {stop.get('node_rank')} stopped the trials ({stop.get('reason')})"
    latest = current.get("trial") or {}
    if latest.get("trial") != trial or latest.get("state") == RECORDED:
        return f"node 0 closed trial {trial}"
    for node, report in (latest.get("nodes") or {}).items():
        if int(node) != node_rank and report.get("outcome") != OK and not report.get("stopped"):
            return f"node {node} ended {report.get('outcome')}"
    return None


class NodeTrials:
    """Runs this node's ranks of each published trial and reports them to the service."""

    def __init__(
        self,
        args: argparse.Namespace,
        pins: TrialPins,
        device_memory: int | None,
        runner: TrialRunner,
        client: TrialClient,
        say: Callable[[str], None],
    ) -> None:
        self.args = args
        self.pins = pins
        self.device_memory = device_memory
        self.runner = runner
        self.client = client
        self.say = say
        self.node_rank = runner.node_rank
        self._stopped_by: str | None = None
        self._unreachable_since: float | None = None

    def run(self, view: dict[str, Any]) -> TrialRun:
        """Run the trial ``view`` (the service's trial object) on this node and report it.
        Raises TrialsStoppedError when the trials were stopped meanwhile."""
        spec = view["spec"]
        number = int(spec["trial"])
        knobs = TrialKnobs.from_json(spec["knobs"])
        script_args = rewrite_script_args(
            list(self.args.training_script_args), self.pins, knobs.micro_batch, knobs.accumulation
        )
        self._stopped_by, self._unreachable_since = None, None
        run = self.runner.run(
            number,
            settings_from_knobs(knobs, self.device_memory),
            script_args,
            int(spec["master_port"]),
            abort=lambda: self._abort(number),
        )
        report = {
            "outcome": run.outcome,
            "duration": round(run.duration, 3),
            "error": run.error,
            "measurements": run.measurements,
            "peak_memory_bytes": run.peak_memory_bytes,
            "stopped": run.stopped is not None,
            "failed_at": run.failed_at,
            "diverged": run.diverged,
        }
        try:
            self.client.report(number, self.node_rank, report)
        except TrialRefusedError as error:
            self.say(f"trial {number}: the service did not take this node's report: {error}")
        except ServiceError as error:
            if self._stopped_by is None:
                self._stopped_by = str(error)
        if self._stopped_by is not None:
            raise TrialsStoppedError(self._stopped_by)
        return run

    def _abort(self, trial: int) -> str | None:
        try:
            current = self.client.current(self.node_rank)
        except ServiceError as error:
            now = time.monotonic()
            if self._unreachable_since is None:
                self._unreachable_since = now
            elif now - self._unreachable_since > SERVICE_LOST_AFTER:
                self._stopped_by = f"{error} for {SERVICE_LOST_AFTER:g} s"
                return self._stopped_by
            return None
        self._unreachable_since = None
        reason = stop_reason(current, trial, self.node_rank)
        if current.get("state") == STOPPED:
            self._stopped_by = reason
        return reason
