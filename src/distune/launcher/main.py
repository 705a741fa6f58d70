"""``distune-run``: torchrun, plus the tuning service's lifecycle around the workers.

Order of events: parse and validate everything (exit 2 on any bad value, before any process
exists); start the service if this node hosts it and wait until it answers; at level 2, run
the trials through it (node 0 searches, the other nodes follow) and keep the winner; hand the
workers their ``DISTUNE_*`` settings through the environment; run the workers with torch's elastic
launcher (restarts included: the service outlives them); whatever the outcome, read the final
status, stop the service and print the summary. The exit code is the workers'.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch.distributed.run as torchrun
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_min_max_nnodes

from distune.errors import ServiceError
from distune.launcher.level2 import (
    Chosen,
    Level2,
    check_batch_pins,
    check_results_dir,
    chosen_run,
    earlier_results,
    pinned_configuration,
    pinned_run,
    trial_world,
)
from distune.launcher.options import (
    ONE_RANK,
    AutotuneOptions,
    OptionError,
    check_training_script,
    local_world_size,
    one_rank,
    parse,
    trial_pins,
    unused_tuning_flags,
)
from distune.launcher.placement import port_taken, rendezvous_wait
from distune.launcher.plan import (
    LaunchPlan,
    drop_trial_variables,
    plan_launch,
    plan_trials,
    restart_caveat,
    take_over_environment,
)
from distune.launcher.progress import ProgressMonitor
from distune.launcher.service_process import ServiceStartError, TuningServiceProcess
from distune.launcher.stop_signals import StopSignals
from distune.launcher.summary import format_summary
from distune.launcher.trial_client import TrialClient, TrialRefusedError
from distune.launcher.trial_follower import TrialFollower
from distune.launcher.trial_node import TrialsStoppedError
from distune.launcher.trial_runner import failure_exit_code
from distune.launcher.tuned_job import JOB_FILE, OtherJobError, TunedJob
from distune.tuning_service.trials.trial_config import TrialPins


def _run_workers(args: Any, plan: LaunchPlan) -> int:
    os.environ.update(plan.settings.to_env())
    waits = rendezvous_wait(args)
    if waits is not None:
        print(f"distune: {waits}", flush=True)
    try:
        torchrun.run(args)
    except ChildFailedError as error:
        print(error.format_msg(), file=sys.stderr)
        return failure_exit_code(error)
    return 0


def _level2(
    argv: list[str], args: Any, options: AutotuneOptions, plan: LaunchPlan
) -> tuple[Any, AutotuneOptions, LaunchPlan] | int:
    """Level 2's trials, coordinated by the service (node 0 searches, every other node
    follows); the job to run next, or the exit code when there is none."""
    assert plan.placement is not None
    client = TrialClient(plan.placement.url, plan.token)
    pins = trial_pins(args)
    mode = options.autotune_mode or "run"
    # With every knob pinned there is nothing to try: each node knows it from its own config.
    untuned = pinned_configuration(pins, trial_world(args)[1], options.autotune_allow_batch_change)
    if plan.starts_service:
        level2 = Level2(args, options, pins, argv, client)
        if untuned is not None:
            chosen: Chosen | None = level2.untuned(untuned)
        else:
            search = level2.tune()
            chosen = level2.chosen(search) if search is not None else None
    elif untuned is not None:
        cap = options.autotune_device_memory
        chosen = chosen_run(args, pins, cap, untuned.stage, untuned)
    else:
        mode, chosen = TrialFollower(args, options, pins, client).follow()
    if chosen is None:
        return 1
    if mode == "tune":
        return 0
    os.environ.update(chosen.settings.to_env())
    args = argparse.Namespace(**{**vars(args), "training_script_args": chosen.script_args})
    # Level 1 tunes distune's DDP (ddp and zero1); FSDP's communication is its own, and one
    # rank has none.
    level = 1 if chosen.stage < 2 and not one_rank(args) else 0
    return args, replace(options, autotune_level=level), plan.for_run(level)


def _trials_then_workers(
    argv: list[str], args: Any, options: AutotuneOptions, plan: LaunchPlan
) -> int:
    """Level 2's trials when asked for, then the workers; the exit code."""
    if options.autotune_level == 2:
        try:
            outcome = _level2(argv, args, options, plan)
        except OptionError as error:
            print(f"distune-run: error: {error}", file=sys.stderr)
            return 2
        except (TrialsStoppedError, ServiceError, TrialRefusedError) as error:
            print(f"distune-run: error: level 2: {error}", file=sys.stderr)
            return 1
        if isinstance(outcome, int):
            return outcome
        args, options, plan = outcome
    return _run_workers(args, plan)


def _plan(argv: list[str]) -> tuple[Any, AutotuneOptions, LaunchPlan] | int:
    """The job's arguments, options and plan (for level 2, the trials' plan); or 2 for bad
    flags."""
    args, options = parse(argv)
    try:
        local_world_size(args)  # a device keyword, resolved only on the machine that runs
        if options.autotune_level == 2:
            # Refuse what trials cannot do, and another job's trials, before anything starts.
            world = trial_world(args)
            pins = trial_pins(args)
            check_batch_pins(pins, world[1], options.autotune_allow_batch_change)
            if options.autotune_resume is not None:
                _check_resume(args, options, pins, world)
            plan = plan_trials(args, options)
            if plan.starts_service:  # node 0 writes the results; another node has its own
                check_results_dir(options)
            check_training_script(args)
            return args, options, plan
        pins = trial_pins(args)
        min_nodes, max_nodes = parse_min_max_nnodes(args.nnodes)
        if min_nodes == max_nodes:  # an elastic job's world is known only as it runs
            # A best_config.json run on another number of ranks would change the global batch.
            check_batch_pins(pins, max_nodes * local_world_size(args), False)
        args = pinned_run(args, options, pins)
        check_training_script(args)
        return args, options, plan_launch(args, options)
    except OptionError as error:
        print(f"distune-run: error: {error}", file=sys.stderr)
        return 2


def _check_resume(
    args: Any, options: AutotuneOptions, pins: TrialPins, world: tuple[int, int]
) -> None:
    """Refuse to resume a directory whose trials cannot be read, or are of another job
    (OptionError)."""
    assert options.autotune_resume is not None
    earlier_results(options.autotune_resume, say_cut=True)  # every finished line a record
    job = TunedJob.of(args, pins, options.autotune_device_memory, world)
    try:
        checked = job.check_resume(options.autotune_resume)
    except OtherJobError as error:
        raise OptionError(f"--autotune_resume: {error}") from None
    if not checked:
        print(
            f"distune-run: warning: --autotune_resume {options.autotune_resume} records no "
            f"{JOB_FILE}, so it cannot be checked to hold this job's trials",
            file=sys.stderr,
        )


def _stop_service(
    service: TuningServiceProcess,
    monitor: ProgressMonitor | None,
    options: AutotuneOptions,
    exit_code: int | None,
) -> None:
    """Stop the service and print the end-of-run summary (``exit_code``: the launcher's, None
    when it stopped on an error of its own, already reported)."""
    if monitor is not None:
        monitor.stop()
    status = service.status()
    service.stop()
    # A service that died was reported once already; the summary then shows the last state it
    # answered.
    gone = monitor is not None and monitor.service_gone
    if status is None and monitor is not None and gone:
        status = monitor.last_status
    if options.autotune_level == 2 and status is not None and not status.get("models"):
        # No training tuned itself after the trials (tune mode, no winner, or FSDP's): level 2
        # has reported its results already, and "no model registered" would only mislead.
        return
    best_file = str(options.autotune_best_file) if options.autotune_best_file else None
    lines = format_summary(
        status,
        service.log_file,
        best_file,
        service_gone=gone,
        exit_code=exit_code,
        launcher_failed=exit_code is None,
    )
    for line in lines:
        print(line, flush=True)


def _warn_before_start(
    args: Any, options: AutotuneOptions, plan: LaunchPlan, dropped: list[str]
) -> None:
    """Say what in the command or the environment will not do what it seems to (stderr);
    ``dropped``: the warnings of :func:`drop_trial_variables`."""
    unused = unused_tuning_flags(args, options, tuned=plan.placement is not None)
    stale = [*dropped, *take_over_environment(plan.settings, os.environ)]
    for caveat in (*stale, restart_caveat(args), unused):
        if caveat is not None:
            print(f"distune-run: warning: {caveat}", file=sys.stderr)
    note = _one_rank_note(args, options)
    if note is not None and unused is None:
        print(f"distune-run: note: {note}", file=sys.stderr)


def _token_file(token: str) -> Path:
    """A new file holding ``token``, which only this user may read (as ``distune status
    --token-file`` requires): the job's own random token is never printed, so without it
    the views could not be used on a single-node job."""
    fd, name = tempfile.mkstemp(prefix="distune_token_")  # mode 0600
    with os.fdopen(fd, "w", encoding="ascii") as file:
        file.write(token + "\n")
    return Path(name)


def _one_rank_note(args: Any, options: AutotuneOptions) -> str | None:
    """What a job of one rank does at level 1 or 2 instead of tuning its communication; None
    for any other job, and where no training follows the trials."""
    if options.autotune_level == 0 or not one_rank(args):
        return None
    if options.autotune_level == 1:
        return f"{ONE_RANK}: it trains untuned, as at --autotune_level 0"
    if options.autotune_mode == "tune":
        return None
    return (
        "this job has one rank (--nnodes 1, --nproc_per_node 1), which exchanges no "
        "gradients: level 2 runs its trials, and the chosen configuration then trains with no "
        "level-1 tuning"
    )


def _port_hint(plan: LaunchPlan) -> str:
    """Why a service of a fixed port may not have started: the port is taken (on several
    nodes, by a second launcher given --node_rank 0 on this machine, say)."""
    placement = plan.placement
    if placement is None or not port_taken(placement):
        return ""
    who = (
        "another program, or another launcher of this job started with --node_rank 0 on this "
        "machine (each node needs its own --node_rank)"
        if placement.multi_node
        else "another program"
    )
    return (
        f"; port {placement.port} on {placement.bind} is in use by {who}; "
        "--autotune_service_port chooses another"
    )


def main(argv: list[str] | None = None) -> int:
    """Run one job; returns the exit code (the workers', 2 for bad flags)."""
    argv = sys.argv[1:] if argv is None else argv
    dropped = drop_trial_variables(os.environ)  # before the plan sets its own
    planned = _plan(argv)
    if isinstance(planned, int):
        return planned
    args, options, plan = planned
    _warn_before_start(args, options, plan, dropped)
    stop_signals = StopSignals()
    stop_signals.install()

    service: TuningServiceProcess | None = None
    monitor: ProgressMonitor | None = None
    exit_code: int | None = None
    token_file: Path | None = None

    def emergency_stop() -> None:
        if service is not None:
            service.stop()
        if token_file is not None:
            token_file.unlink(missing_ok=True)

    try:
        if plan.starts_service:
            token = plan.token
            assert token is not None
            service = TuningServiceProcess.start(list(plan.service_args), token)
            plan = plan.with_service_port(service.port)
            print(f"distune: tuning service at {service.url} (pid {service.pid})", flush=True)
            if plan.token_made_here:
                token_file = _token_file(token)
                print(
                    f"distune: watch it with: distune status --watch --service {service.url} "
                    f"--token-file {shlex.quote(str(token_file))} (the job's token, readable "
                    "by you alone, removed when the job ends; the dashboard at the service's "
                    "URL asks for it)",
                    flush=True,
                )
            monitor = ProgressMonitor(service, quiet=options.autotune_quiet)
            monitor.start()
        # Threads start only now: the service's start-up (preexec_fn) needs a thread-free fork.
        stop_signals.watch(emergency_stop, helpers=() if service is None else (service.pid,))
        exit_code = _trials_then_workers(argv, args, options, plan)
        return exit_code
    except ServiceStartError as error:
        print(f"distune-run: error: tuning service: {error}{_port_hint(plan)}", file=sys.stderr)
        return 1
    except SignalException as error:
        print(f"distune-run: stopping on {error.sigval.name}", file=sys.stderr)
        exit_code = 128 + error.sigval
        return exit_code
    finally:
        stop_signals.cleanup_started()
        if service is not None:
            _stop_service(service, monitor, options, exit_code)
        if token_file is not None:
            token_file.unlink(missing_ok=True)
