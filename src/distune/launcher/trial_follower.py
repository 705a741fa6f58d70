"""Level 2 on a node other than node 0: run each trial node 0 publishes, until it finishes.

The launcher of node ``i > 0`` polls the service (on node 0) for the current trial, runs its
own ranks of each new one (:class:`~distune.launcher.trial_node.NodeTrials`) and reports them;
when node 0 posts the end of the search, it returns the chosen configuration, which this node
then trains with in ``run`` mode, exactly as node 0 does. Its trial logs are in a directory of
its own: ``node-<i>/`` under ``--autotune_results_dir`` or a new private one in /tmp.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing import SignalException

from distune.errors import ServiceError
from distune.launcher.level2 import DEFAULT_TRIAL_TIMEOUT, Chosen, trial_world
from distune.launcher.options import AutotuneOptions, OptionError
from distune.launcher.trial_args import rewrite_script_args
from distune.launcher.trial_client import NothingListeningError, TrialClient, TrialRefusedError
from distune.launcher.trial_node import NodeTrials, TrialsStoppedError, settings_from_knobs
from distune.launcher.trial_runner import TrialRunner
from distune.launcher.tuned_job import TunedJob
from distune.tuning_service.trial_board import FINISHED, RUNNING, STOPPED
from distune.tuning_service.trial_messages import TrialKnobs
from distune.tuning_service.trials.trial_config import TrialPins

#: Seconds a follower waits for node 0's service to answer at all (node 0 may start later).
START_WAIT = 300.0
#: Seconds of refused connections before a follower says so once, while it goes on waiting:
#: longer than launchers started together take to bring node 0's service up.
REFUSED_HINT_AFTER = 10.0
_POLL = 0.3


def _trials_dir(options: AutotuneOptions, node_rank: int) -> Path:
    if options.autotune_results_dir is None:
        return Path(tempfile.mkdtemp(prefix=f"distune_level2_node{node_rank}_"))
    path = options.autotune_results_dir / f"node-{node_rank}"
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


class TrialFollower:
    """Node ``i > 0``'s side of a level-2 tuning."""

    def __init__(
        self,
        args: argparse.Namespace,
        options: AutotuneOptions,
        pins: TrialPins,
        client: TrialClient,
    ) -> None:
        self.args = args
        self.options = options
        self.pins = pins
        self.client = client
        timeout = options.autotune_trial_timeout or DEFAULT_TRIAL_TIMEOUT
        self.trials_dir = _trials_dir(options, int(args.node_rank))
        runner = TrialRunner(args, timeout, self.trials_dir)
        self.node = NodeTrials(
            args, pins, options.autotune_device_memory, runner, client, self._say
        )
        world = trial_world(args)
        self.job = TunedJob.of(args, pins, options.autotune_device_memory, world).as_given(args)
        # After the first answer, the service may be silent this long between trials: node 0
        # waits up to a trial time-out and more for a late node before it records a trial.
        self.lost_after = 2 * timeout + 60.0

    def _say(self, text: str) -> None:
        if not self.options.autotune_quiet:
            print(f"distune: node {self.node.node_rank}: {text}", flush=True)

    def follow(self) -> tuple[str, Chosen | None]:
        """Run trials until node 0 finishes: its mode and the chosen configuration (None when
        no trial ended ok). Raises TrialsStoppedError when a node stopped the trials or the
        service is gone."""
        self._say(f"following node 0's trials at {self.client.url}; logs in {self.trials_dir}")
        try:
            return self._follow()
        except SignalException as error:
            with contextlib.suppress(ServiceError, TrialRefusedError):
                self.client.stop(self.node.node_rank, error.sigval.name)
            raise

    def _follow(self) -> tuple[str, Chosen | None]:
        done: set[int] = set()
        started = last_answer = time.monotonic()
        answered = hinted = False
        while True:
            try:
                current = self.client.current(self.node.node_rank)
            except ServiceError as error:
                waited = time.monotonic() - (last_answer if answered else started)
                if waited > (self.lost_after if answered else START_WAIT):
                    raise TrialsStoppedError(f"{error} for {waited:.0f} s") from None
                refused = isinstance(error, NothingListeningError)
                if refused and not answered and not hinted and waited >= REFUSED_HINT_AFTER:
                    hinted = True
                    self._warn_refused()
                time.sleep(1.0)
                continue
            answered, last_answer = True, time.monotonic()
            if current["state"] == STOPPED:
                stop = current["stop"]
                raise TrialsStoppedError(
                    f"node {stop['node_rank']} stopped the trials ({stop['reason']})"
                )
            if current["state"] == FINISHED:
                return self._finished(current["finish"])
            trial = current["trial"]
            runnable = (
                trial is not None
                and trial["state"] == RUNNING
                and trial["spec"] is not None
                and trial["trial"] not in done
                and str(self.node.node_rank) not in trial["nodes"]
            )
            if runnable:
                self._check_job(trial["spec"].get("job"))
                done.add(trial["trial"])
                self._say(f"trial {trial['trial']}: running this node's ranks")
                run = self.node.run(trial)
                self._say(f"trial {trial['trial']}: this node's ranks ended {run.outcome}")
            else:
                time.sleep(_POLL)

    def _warn_refused(self) -> None:
        """Say once, early, that node 0's address answers but nothing listens at the URL: a
        wrong --autotune_service_addr (or port) would otherwise be silent for START_WAIT."""
        print(
            f"distune: node {self.node.node_rank}: still trying to reach the tuning service at "
            f"{self.client.url}: connection refused; is --autotune_service_addr (or "
            "--master_addr, --autotune_service_port) node 0's? waiting up to "
            f"{START_WAIT:g} s for node 0 to start it",
            file=sys.stderr,
            flush=True,
        )

    def _check_job(self, theirs: dict[str, Any] | None) -> None:
        """Refuse (OptionError), and stop every node's trials, where node 0 launched another
        job (other script arguments, ranks, cap or config): a trial of mixed ranks would
        measure neither, and the run would train neither."""
        if theirs is None:
            return  # a node 0 of an earlier version publishes no job
        differences = self.job.differences(theirs, "on node 0")
        if not differences:
            return
        node = self.node.node_rank
        reason = (
            f"node {node} was started with another job than node 0's (its "
            f"{', '.join(d.split(':', 1)[0] for d in differences)} differ): every node runs the "
            "same command, but for --node_rank"
        )
        with contextlib.suppress(ServiceError, TrialRefusedError):
            self.client.stop(node, reason[:200])
        raise OptionError(
            f"--autotune_level 2: node {node} was started with another job than node 0's "
            f"({'; '.join(differences)}); start every node with the same script, arguments, "
            "--nproc_per_node, --nnodes, memory cap and --autotune_config, each with its own "
            "--node_rank"
        )

    def _finished(self, finish: dict[str, Any]) -> tuple[str, Chosen | None]:
        mode = str(finish["mode"])
        if finish["chosen"] is None:
            return mode, None
        knobs = TrialKnobs.from_json(finish["knobs"])
        script_args = rewrite_script_args(
            list(self.args.training_script_args), self.pins, knobs.micro_batch, knobs.accumulation
        )
        settings = settings_from_knobs(knobs, self.options.autotune_device_memory)
        self._say(f"node 0 chose trial {finish['chosen']}")
        return mode, Chosen(knobs.stage or 0, script_args, settings)
