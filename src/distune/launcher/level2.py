"""``distune-run --autotune_level 2``: trials of the user's script, then (mode ``run``) the
real training with the winner.

Order of events: a profile trial runs the script as it is (pinned values applied) and measures
what the memory model needs; then the search (:mod:`distune.tuning_service.trials`) proposes
trials until it is done or ``--autotune_max_trials`` is spent; each trial's record is appended
to ``trials.jsonl`` as it ends; finally ``best_config.json``, ``best_command.txt`` and
``summary.md`` are written. Every value distune chooses is printed as a progress line.
Trials are coordinated by the tuning service (``tuning_service.trial_board``), on one node or
several: node 0 (this module) runs the search and publishes each trial, every node's launcher
runs its own ranks of it (``trial_node``, ``trial_follower``) at a rendezvous port node 0 chose,
and node 0 records the combined outcome. docs/level2.md has the protocol.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import shlex
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.run import parse_min_max_nnodes

from distune.cut_line import parse_keeping_finished
from distune.errors import ServiceError
from distune.launcher.config_file import load_config
from distune.launcher.options import AutotuneOptions, OptionError, flags, local_world_size
from distune.launcher.trial_args import rewrite_script_args, script_batch
from distune.launcher.trial_client import TrialClient, TrialRefusedError
from distune.launcher.trial_node import NodeTrials
from distune.launcher.trial_report import TrialReport
from distune.launcher.trial_runner import TrialRunner
from distune.launcher.tuned_job import JOB_FILE, TunedJob
from distune.trial_settings import TrialSettings
from distune.tuning_service.trial_board import OUTCOME_PRIORITY
from distune.tuning_service.trials.memory_model import MemoryModel, ModelFacts
from distune.tuning_service.trials.trial_config import (
    ACCUMULATION,
    MICRO_BATCH,
    TrialConfig,
    TrialConfigError,
    TrialPins,
)
from distune.tuning_service.trials.trial_result import (
    CRASH,
    OK,
    OOM,
    THROUGHPUT,
    TIMEOUT,
    TrialRecordError,
    TrialResult,
    parse_trial_lines,
)
from distune.tuning_service.trials.trial_search import Proposal, TrialSearch
from distune.tuning_service.trials.trial_space import TrialSpace

DEFAULT_MAX_TRIALS = 20
#: The purpose of trial 0: the script's own configuration, as it runs without distune.
PROFILE = "profile"
DEFAULT_TRIAL_TIMEOUT = 120.0
#: The profile result's ``api`` of a script measured through its DistributedDataParallel,
#: and of one that calls distune.prepare.
WRAPPER_API = "wrapper"
PREPARE_API = "prepare"
_TAKING_PART = (
    " (a script takes part in level 2 by calling distune.prepare, or by wrapping its model in "
    "distune.DistributedDataParallel with its batch flags named in the config's arg_mappings)"
)


#: Where the script's own configuration runs out of memory: the search measures everything
#: from that trial, so it cannot start; what can.
_START_THAT_FITS = (
    ". Level 2 measures the model in the script's own configuration first, so that one must "
    "fit: give the script a smaller micro-batch with more accumulation steps (the same global "
    "batch), or pin a configuration that saves memory in --autotune_config "
    "(zero_optimization: {stage: 3}, activation_checkpointing: true; the search then keeps "
    "what is pinned), or, with --autotune_device_memory, a larger cap"
)


def profile_failed(profile: TrialResult) -> str:
    """What is said where the profile trial did not end ok. It tells how to take part in
    level 2 only where the script did not: no step of it finished under distune, and it did not
    fail on its own (out of memory, a crash)."""
    took_part = profile.steps is not None
    hint = "" if profile.outcome in (OOM, CRASH) or took_part else _TAKING_PART
    if profile.outcome == OOM:
        hint = _START_THAT_FITS
    return (
        f"the profile trial (the script's own configuration) ended {profile.outcome}: "
        f"nothing to tune from; see its log{hint}"
    )


def no_blocks_notice(untried: tuple[str, ...]) -> str:
    """Said where the profile found no repeated blocks (a ModuleList or Sequential of two or
    more modules, all of one class), which ZeRO-3 and activation checkpointing wrap, and that
    took ``untried`` knobs out of the search."""
    verb, them = ("are", "them") if len(untried) > 1 else ("is", "it")
    return (
        "the model has no repeated blocks (a ModuleList or Sequential of two or more modules, all "
        f"of one class), so {' and '.join(untried)} {verb} not tried; pass blocks=(YourBlock,) "
        f"to distune.prepare to try {them}"
    )


def batch_norm_notice(facts: dict[str, Any], space: TrialSpace, own: TrialConfig) -> str | None:
    """Said where the profile found batch norms in the model and the search may change the
    micro-batch: their statistics are over each micro-batch, so the global batch held is not
    the training held (a ResNet at 2 x 8 normalises over 2 samples where the script's 16 x 1
    did over 16). None where there are none, or the micro-batch cannot change."""
    norms = facts.get("batch_norms")
    if not isinstance(norms, int) or norms < 1 or len(space.micro_batches()) < 2:
        return None
    counted, their = (f"{norms} batch norms", "their") if norms > 1 else ("a batch norm", "its")
    return (
        f"the model has {counted}: {their} statistics are over each micro-batch, so a trial "
        f"at another micro-batch than the script's own ({own.micro_batch}) trains with other "
        "statistics (the same global "
        f"batch, not the same math); pin train_micro_batch_size_per_gpu: {own.micro_batch} in "
        "--autotune_config to keep it"
    )


#: Seconds node 0 waits for the other nodes' reports beyond the trial time-out (their own
#: watchdogs fire within the time-out, and stopping takes a few seconds more).
LATE_REPORT_GRACE = 15.0
_POLL = 0.2
#: Seconds node 0 waits for the other nodes' reports before it says so.
WAITING_NOTICE = 5.0
#: Seconds node 0 keeps its service for the other nodes to see the end of the trials (they
#: ask twice a second or more; one still in a trial stops it first) or a stop.
FINISH_ACK_WAIT = 30.0
STOP_ACK_WAIT = 10.0


@dataclass(frozen=True)
class Chosen:
    """What ``run`` mode trains with: the winner's strategy, script arguments and settings."""

    stage: int
    script_args: list[str]
    settings: TrialSettings


def space_pins(pins: TrialPins, profile: TrialConfig, api: str | None) -> TrialPins:
    """What the search may change: ``pins`` for a script that calls ``distune.prepare``; for
    one measured through its wrapper only (``api`` ``wrapper``), DDP in full precision without
    checkpointing and only the batch knobs its ``arg_mappings`` reach (the others stay the
    script's own)."""
    if api != WRAPPER_API:
        return pins
    mapped = dict(pins.arg_mappings)
    if not mapped:
        raise TrialConfigError(
            "the script never calls distune.prepare and the config has no arg_mappings: level 2 "
            "can change nothing in it. Call distune.prepare (micro-batch, accumulation, ZeRO "
            "stages, checkpointing), or map its batch flags, e.g. arg_mappings: "
            f"{{{MICRO_BATCH}: --batch_size, {ACCUMULATION}: --grad_accum}}"
        )
    if pins.stage not in (None, 0) or pins.checkpointing or pins.bf16:
        raise TrialConfigError(
            "the config pins a ZeRO stage, activation checkpointing or bf16, which need the "
            "script to call distune.prepare; this one only wraps its model in "
            "distune.DistributedDataParallel"
        )
    return replace(
        pins,
        stage=0,
        checkpointing=False,
        bf16=False,
        micro_batch=pins.micro_batch if MICRO_BATCH in mapped else profile.micro_batch,
        accumulation=pins.accumulation if ACCUMULATION in mapped else profile.accumulation,
    )


def batch_moved(profile: TrialResult, result: TrialResult, flag: str | None) -> str | None:
    """Why the search must stop where a trial found its micro-batch in another dimension of
    the script's first input than the profile did. A ``prepare`` script then builds its
    batches from its own size, not ``run.micro_batch_size`` (the trial's size only happened
    to be another dimension's, a feature width of 32): the trial ran another configuration
    than the one it would be measured as. A script measured through its wrapper was profiled
    told no micro-batch (its mapped flag left to its default), so the profile read the first
    dimension of a sequence-first input, and the global batch everything keeps is wrong. None
    where they agree (or either does not say)."""
    read = (profile.facts or {}).get("batch_dimensions")
    found = (result.facts or {}).get("batch_dimensions")
    if not read or not found or set(read) & set(found):
        return None
    if (profile.facts or {}).get("api") == PREPARE_API:
        return (
            f"trial {result.trial}: distune.prepare set the micro-batch to "
            f"{result.config.micro_batch}, which the script's first input holds only in "
            f"dimension {found[0]}, but the profile trial's micro-batch "
            f"({profile.config.micro_batch}) was in dimension {read[0]}: the script builds its "
            "batches from its own size (a data loader made before prepare, say), not "
            "run.micro_batch_size, so no trial runs the configuration it would be measured as; "
            "build each micro-batch with run.micro_batch_size samples"
        )
    return (
        f"trial {result.trial} found its micro-batch ({result.config.micro_batch}) in dimension "
        f"{found[0]} of the script's first input, but the profile trial read dimension {read[0]} "
        f"({profile.config.micro_batch}) as the script's own micro-batch, so the global batch "
        f"the trials keep is not the script's; give {flag or 'the mapped flag'} on the command "
        "line (the profile then looks for its value in every dimension)"
    )


def trial_space(
    pins: TrialPins,
    world_size: int,
    profile: TrialConfig,
    facts: dict[str, Any],
    allow_batch_change: bool,
) -> TrialSpace:
    """The configurations the search may try after the profile trial measured ``facts``: the
    pins as :func:`space_pins` leaves them, and no ZeRO-3 or checkpointing for a model the
    profile found no repeated blocks in (a ``trials.jsonl`` from before that fact assumes
    blocks)."""
    return TrialSpace(
        space_pins(pins, profile, facts.get("api")),
        world_size,
        profile,
        allow_batch_change,
        repeated_blocks=facts.get("repeated_block_classes", 1) > 0,
    )


def settings_for(config: TrialConfig | None, pins: TrialPins, cap: int | None) -> TrialSettings:
    """The ranks' settings: a configuration's knobs, or (``None``) the pinned ones only."""
    if config is None:
        return TrialSettings(
            pins.micro_batch, pins.accumulation, pins.stage, pins.checkpointing, cap, bf16=pins.bf16
        )
    return TrialSettings(
        config.micro_batch,
        config.accumulation,
        config.stage,
        config.checkpointing,
        cap,
        bf16=config.bf16,
    )


def _knobs(settings: TrialSettings) -> dict[str, Any]:
    """The knobs of a trial (or of the winner) as the service publishes them to every node."""
    return {
        "micro_batch": settings.micro_batch,
        "accumulation": settings.accumulation,
        "stage": settings.stage,
        "checkpointing": settings.checkpointing,
        "bf16": settings.bf16,
    }


def run_as(results: list[TrialResult], best: TrialConfig) -> TrialConfig | None:
    """How the winner runs: with its own knobs where a trial that set them ran ok, else (None)
    as the profile ran it, the script's own values with the pinned ones only. A winner only
    the profile measured is the script's own configuration, and every trial that set it may
    have failed for a reason the profile never met (a mapped flag the script rejects)."""
    measured = (r for r in results if r.config == best and r.outcome == OK)
    return best if any(r.purpose != PROFILE for r in measured) else None


def mapped_flags_failed(results: list[TrialResult], pins: TrialPins) -> str | None:
    """What to tell the user where every trial that set the flags ``arg_mappings`` names
    failed while the profile, which left them as they were, ran: the likeliest cause is a flag
    the script does not take. None otherwise."""
    tried = [r for r in results if r.purpose != PROFILE]
    if not pins.arg_mappings or not tried or any(r.outcome == OK for r in tried):
        return None
    flags = " and ".join(flag for _, flag in pins.arg_mappings)
    first = tried[0]
    why = (first.error or "").strip().splitlines()
    return (
        f"no trial that set {flags} (the config's arg_mappings) ended ok; the first, trial "
        f"{first.trial}, ended {first.outcome}{f' ({why[-1][:160]})' if why else ''}: does the "
        "script take these flags? The winner runs with the script's own arguments"
    )


def command_without_tuning(argv: list[str], args: argparse.Namespace, best: Path) -> list[str]:
    """The launcher command that runs ``best`` with tuning off: ``--autotune_level 0
    --autotune_config best``, the job's own torchrun flags (first, so that a ``--`` before the
    script stays there), then the script and its arguments."""
    script_at = len(argv) - len(args.training_script_args) - 1
    launcher, rest = argv[:script_at], argv[script_at:]
    switches = {f"__{dest}" for dest, flag in flags() if flag.kind != "value"}
    kept: list[str] = []
    skip = False
    for arg in launcher:
        name = arg.split("=", 1)[0].replace("-", "_")
        if skip:
            skip = False
        elif name.startswith("__autotune") or name in ("__is_output_autotune_log",):
            # Flags with a value take the next argument unless written --flag=value.
            skip = "=" not in arg and name not in switches
        else:
            kept.append(arg)
    return ["distune-run", "--autotune_level", "0", "--autotune_config", str(best), *kept, *rest]


def carried_settings(config: str | None) -> dict[str, Any]:
    """The settings of the job's own ``--autotune_config`` that the winner's run keeps and
    ``best_config.json`` must carry, since ``best_command.txt`` runs with that file instead:
    every launcher setting but the tuning's own (``autotune_*``), such as a pinned
    ``bucket_size`` or ``hierarchical_reduce``. The file was checked when the job started."""
    if config is None:
        return {}
    kept = {dest for dest, _ in flags() if not dest.startswith(("autotune_", "is_output_"))}
    return {key: value for key, value in load_config(Path(config)).items() if key in kept}


def free_port() -> int:
    """A TCP port nothing listens on now, on loopback (a trial's rendezvous)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def resumes_in_place(options: AutotuneOptions) -> bool:
    """Whether the results go to the directory being resumed (however each is spelled)."""
    given, resumed = options.autotune_results_dir, options.autotune_resume
    return given is not None and resumed is not None and given.resolve() == resumed.resolve()


def check_results_dir(options: AutotuneOptions) -> None:
    """Refuse (OptionError) a results directory that holds another level-2 run (its
    ``job.json`` is written as it starts, its ``trials.jsonl`` as its first trial ends: two
    runs at once would mix their records), unless it is the one being resumed."""
    path = options.autotune_results_dir
    if path is None or resumes_in_place(options):
        return
    if (path / "trials.jsonl").exists():
        raise OptionError(
            f"--autotune_results_dir {path} already holds trials.jsonl of a level-2 run; choose "
            "another directory, or pass it as --autotune_resume to go on from it"
        )
    if (path / JOB_FILE).exists():
        # No trial recorded: nothing to resume (--autotune_resume wants a trials.jsonl).
        raise OptionError(
            f"--autotune_results_dir {path} already holds {JOB_FILE} of a level-2 run that "
            "recorded no trial: it is running now, or was stopped before its first trial "
            f"ended, with nothing to resume; choose another directory, or delete {path / JOB_FILE} "
            "if no run uses it"
        )


def _results_dir(options: AutotuneOptions) -> Path:
    if options.autotune_results_dir is None:
        return Path(tempfile.mkdtemp(prefix="distune_level2_"))
    check_results_dir(options)
    path = options.autotune_results_dir
    try:
        path.mkdir(mode=0o700, exist_ok=True)
    except OSError as error:
        raise OptionError(f"--autotune_results_dir {path}: {error.strerror or error}") from None
    return path


def model_facts(measurements: dict[str, Any], config: TrialConfig) -> ModelFacts:
    """The memory model's facts from a profile trial's measurements."""
    return ModelFacts(
        parameter_bytes=int(measurements["parameter_bytes"]),
        gradient_bytes=int(measurements["gradient_bytes"]),
        optimizer_state_bytes=int(measurements["optimizer_state_bytes"]),
        largest_block_bytes=int(measurements["largest_block_bytes"]),
        activation_bytes_per_sample=int(measurements["activation_bytes_per_sample"]),
        profile=config,
        profile_peak_bytes=int(measurements["peak_memory_bytes"]),
        world_size=int(measurements["world_size"]),
        checkpointed_bytes_per_sample=measurements.get("checkpointed_activation_bytes_per_sample"),
    )


def trial_world(args: argparse.Namespace) -> tuple[int, int]:
    """The trials' node count and world size; OptionError for a job whose trials cannot be
    coordinated (an elastic node range, a rendezvous other than static)."""
    min_nodes, max_nodes = parse_min_max_nnodes(args.nnodes)
    local = local_world_size(args)
    if max_nodes > 1 and not args.standalone:
        if min_nodes != max_nodes:
            raise OptionError(
                f"--autotune_level 2: --nnodes {args.nnodes}: trials need a fixed number of "
                "nodes (e.g. --nnodes 2), since every trial runs on all of them"
            )
        if args.rdzv_backend != "static" or args.rdzv_endpoint:
            raise OptionError(
                "--autotune_level 2 on several nodes uses static rendezvous (--master_addr, "
                "--master_port, --node_rank on every node); got --rdzv_backend "
                f"{args.rdzv_backend}{' with --rdzv_endpoint' if args.rdzv_endpoint else ''}"
            )
        return max_nodes, max_nodes * local
    return 1, local


def earlier_results(directory: Path, say_cut: bool = False) -> list[TrialResult]:
    """The trials recorded in ``directory``'s ``trials.jsonl`` (``--autotune_resume``); a last
    line cut short (the run stopped while writing it) is left out, saying so where
    ``say_cut``; OptionError naming a finished line that holds no trial record (a file
    edited)."""
    path = directory / "trials.jsonl"
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise OptionError(f"--autotune_resume: cannot read {path}: {error}") from None
    try:
        return parse_keeping_finished(
            path,
            text,
            lambda finished: parse_trial_lines(finished.splitlines()),
            TrialRecordError,
            say_cut,
        )
    except TrialRecordError as error:
        raise OptionError(
            f"--autotune_resume: {path} line {error.number} is not a trial record "
            f"({type(error.cause).__name__}: {error.cause}); resume from an intact trials.jsonl "
            "or start afresh"
        ) from None


def check_batch_pins(pins: TrialPins, world_size: int, allow_batch_change: bool) -> None:
    """Refuse now (OptionError) pinned batch values that no trial can keep on ``world_size``
    ranks, where the pins alone fix the global batch (otherwise the profile trial tells it);
    the search's own space checks them, with the pins standing in for the profile."""
    fixed = pins.global_batch is not None or None not in (pins.micro_batch, pins.accumulation)
    if not fixed:
        return
    pinned = TrialConfig(pins.micro_batch or 1, pins.accumulation or 1, 0, False)
    try:
        TrialSpace(pins, world_size, pinned, allow_batch_change)
    except TrialConfigError as error:
        raise OptionError(f"--autotune_config: {error}") from None


def has_one_configuration(space: TrialSpace) -> bool:
    """Whether ``space`` leaves a single configuration: nothing to search."""
    knobs = (space.stages(), space.checkpointing(), space.precisions(), space.micro_batches())
    return all(len(values) == 1 for values in knobs)


def pinned_configuration(
    pins: TrialPins, world_size: int, allow_batch_change: bool
) -> TrialConfig | None:
    """The one configuration ``pins`` leave where they fix every level-2 knob before any
    trial (a ``best_config.json`` as the config, say): nothing to tune, no trial to run. None
    where a knob is left to choose, or the script's own batch is (its profile tells it)."""
    micro, accumulation = pins.micro_batch, pins.accumulation
    if accumulation is None and micro and pins.global_batch and not allow_batch_change:
        accumulation, rest = divmod(pins.global_batch, world_size * micro)
        if rest:
            return None
    if None in (micro, accumulation, pins.stage, pins.checkpointing, pins.bf16):
        return None
    assert micro is not None and accumulation is not None and pins.stage is not None
    try:
        config = TrialConfig(
            micro, accumulation, pins.stage, bool(pins.checkpointing), bool(pins.bf16)
        )
        space = TrialSpace(pins, world_size, config, allow_batch_change)
    except TrialConfigError:
        return None  # the trials' own path reports what is wrong
    return config if has_one_configuration(space) and space.contains(config) else None


def chosen_run(
    args: argparse.Namespace, pins: TrialPins, cap: int | None, stage: int, run: TrialConfig | None
) -> Chosen:
    """What ``run`` mode trains with: ``run``'s knobs (None: the script's own values with
    the pinned ones), mapped flags rewritten, the winner's ``stage``."""
    settings = settings_for(run, pins, cap)
    script_args = rewrite_script_args(
        list(args.training_script_args), pins, settings.micro_batch, settings.accumulation
    )
    return Chosen(stage, script_args, settings)


def trial_port(args: argparse.Namespace) -> int:
    """A free port for a trial's rendezvous on node 0, where the other nodes can reach it."""
    nnodes, _ = trial_world(args)
    if nnodes == 1:
        return free_port()
    with socket.socket() as probe:
        try:
            probe.bind((args.master_addr, 0))
        except OSError as error:
            raise OptionError(
                f"--master_addr {args.master_addr}: node 0 cannot listen there for its trials' "
                f"rendezvous ({error.strerror or error}); give node 0's own address"
            ) from None
        return int(probe.getsockname()[1])


class Level2:
    """One level-2 tuning of one script, run by node 0: the search, each trial published to
    the service for every node to run, the results directory."""

    def __init__(
        self,
        args: argparse.Namespace,
        options: AutotuneOptions,
        pins: TrialPins,
        argv: list[str],
        client: TrialClient,
    ) -> None:
        self.nnodes, self.world_size = trial_world(args)
        self.args = args
        self.options = options
        self.argv = argv
        self.pins = pins
        self.client = client
        self.metric = options.autotune_metric or THROUGHPUT
        self.max_trials = options.autotune_max_trials or DEFAULT_MAX_TRIALS
        self.trial_timeout = options.autotune_trial_timeout or DEFAULT_TRIAL_TIMEOUT
        #: Seconds node 0 waits, once its ranks ended, for the other nodes' reports.
        self.late_after = self.trial_timeout + LATE_REPORT_GRACE
        self.results_dir = _results_dir(options)
        job = TunedJob.of(args, pins, options.autotune_device_memory, trial_world(args))
        job.write(self.results_dir)
        #: What every other node checks its own launch against (TrialFollower).
        self.node_job = job.as_given(args).to_json()
        self.report = TrialReport(self.results_dir, self.metric)
        runner = TrialRunner(args, self.trial_timeout, self.results_dir / "trials")
        self.node = NodeTrials(
            args, pins, options.autotune_device_memory, runner, client, self._say
        )
        self.earlier = self._earlier_results()
        if resumes_in_place(options):
            # Resuming in place: the reused trials are written again as they are reused, and
            # the earlier records are kept beside them (a stop before every one was reused, or
            # a search that no longer proposes some, must not lose a finished row).
            kept = next(
                path
                for n in itertools.count(1)
                if not (path := self.results_dir / f"trials.before-resume-{n}.jsonl").exists()
            )
            os.replace(self.results_dir / "trials.jsonl", kept)
        #: Nodes that reported the last trial (all of them until a trial ends).
        self.answering = set(range(self.nnodes))
        self.started = time.monotonic()
        #: The search once the profile trial ran (a stop writes the summary of its trials).
        self.search: TrialSearch | None = None
        #: What was said of the whole search before it began (pins, knobs left out), which
        #: summary.md lists first among its decisions.
        self.notices: list[str] = []

    def _earlier_results(self) -> list[TrialResult]:
        if self.options.autotune_resume is None:
            return []
        return earlier_results(self.options.autotune_resume)

    def _say(self, text: str) -> None:
        if not self.options.autotune_quiet:
            print(f"distune: {text}", flush=True)

    def _notice(self, text: str) -> None:
        """Say ``text`` and keep it for summary.md: what the search leaves out, and why."""
        self._say(text)
        self.notices.append(text)

    def _reused(self, index: int, config: TrialConfig | None, purpose: str) -> TrialResult | None:
        for earlier in self.earlier:
            # The profile is the script's own configuration, whatever it turned out to be.
            same = config is None or earlier.config == config
            if same and earlier.purpose == purpose:
                self.earlier.remove(earlier)
                return replace(earlier, trial=index)
        return None

    def _trial(
        self,
        index: int,
        config: TrialConfig | None,
        purpose: str,
        predicted: int | None,
        refuse: Callable[[TrialResult], str | None] | None = None,
        batch_change: str | None = None,
    ) -> TrialResult:
        """Run (or, resuming, reuse) one trial on every node and record it; one that ran ok
        but ``refuse`` says did not run its configuration is recorded as a crash saying so.
        ``batch_change`` says how its global batch differs from the script's own, as its
        record (``trials.jsonl``, the board, the summary) carries it."""
        reused = self._reused(index, config, purpose)
        if reused is not None:
            reused = replace(reused, batch_change=batch_change)
            self._say(f"trial {index}: {reused.describe()}: {reused.outcome} (resumed)")
            self.client.record(index, reused.to_json())
            self.report.add(reused)
            return reused
        what = config.describe() if config is not None else "the script's own configuration"
        predicted_text = f", predicted peak {predicted / 2**20:.1f} MiB" if predicted else ""
        self._say(f"trial {index}/{self.max_trials} ({purpose}): {what}{predicted_text}")
        # The profile runs the script's own arguments: its ranks are told the batch they give.
        pins = (
            self.pins
            if config is not None
            else script_batch(list(self.args.training_script_args), self.pins)
        )
        settings = settings_for(config, pins, self.options.autotune_device_memory)
        view = self.client.publish(
            {
                "trial": index,
                "nnodes": self.nnodes,
                "purpose": purpose,
                "knobs": _knobs(settings),
                "master_port": trial_port(self.args),
                "config": None if config is None else config.to_config(self.world_size),
                "metric": self.metric,
                "job": self.node_job,
            }
        )
        run = self.node.run(view)
        combined = self._combined(index)
        measured = combined.get("measurements") or {}
        result = TrialResult(
            trial=index,
            config=config or self._profile_config(measured),
            world_size=self.world_size,
            outcome=combined["outcome"],
            purpose=purpose,
            throughput=measured.get("throughput"),
            throughput_spread=measured.get("throughput_spread"),
            step_seconds=measured.get("step_seconds"),
            peak_memory_bytes=measured.get("peak_memory_bytes"),
            predicted_memory_bytes=predicted,
            duration=run.duration,
            log_path=str(run.log_path),
            error=combined.get("error"),
            facts=measured or None,
            steps=run.steps,
            batch_change=batch_change,
            diverged=combined.get("diverged") is True,
        )
        why = refuse(result) if refuse is not None and result.outcome == OK else None
        if why is not None:  # never recorded as measuring what it did not run
            result = replace(
                result, outcome=CRASH, error=why, throughput=None, throughput_spread=None,
                step_seconds=None,
            )  # fmt: skip
        self.client.record(index, result.to_json())
        self.report.add(result)
        self._say(self.report.line(result))
        return result

    def _profile_config(self, measured: dict[str, Any]) -> TrialConfig:
        reported = measured.get("config")
        if reported is None:  # as far as the pins and the script's own mapped flags tell
            told = script_batch(list(self.args.training_script_args), self.pins)
            return TrialConfig(
                told.micro_batch or 1,
                told.accumulation or 1,
                self.pins.stage or 0,
                bool(self.pins.checkpointing),
                bool(self.pins.bf16),
            )
        return TrialConfig(
            reported["micro_batch"],
            reported["accumulation"],
            reported["stage"],
            reported["checkpointing"],
            reported.get("bf16", False),
        )

    def _combined(self, index: int) -> dict[str, Any]:
        """The trial's outcome over every node, once each reported; a node that does not
        report within the trial time-out after this node's ranks ended counts as ``timeout``."""
        start = time.monotonic()
        told = False
        while True:
            view = self.client.trial(index)
            # The nodes that answer: at the end, only they are waited for.
            self.answering = {int(node) for node in view["nodes"]}
            if view["combined"] is not None:
                return dict(view["combined"])
            waited = time.monotonic() - start
            if waited > self.late_after:
                break
            if not told and waited > WAITING_NOTICE:
                missing = ", ".join(str(node) for node in view["missing"])
                self._say(
                    f"trial {index}: waiting for node {missing} (at most {self.late_after:g} s)"
                )
                told = True
            time.sleep(_POLL)
        missing = ", ".join(str(node) for node in view["missing"])
        causes = [
            (TIMEOUT, f"node {missing}: no report {self.late_after:g} s after node 0's ranks ended")
        ]
        causes += [
            (r["outcome"], f"node {node}: {r['error']}")
            for node, r in view["nodes"].items()
            if not r["stopped"] and r["outcome"] != OK
        ]
        outcome, error = min(causes, key=lambda cause: OUTCOME_PRIORITY.index(cause[0]))
        return {"outcome": outcome, "error": error, "measurements": None}

    def tune(self) -> TrialSearch | None:
        """Run the trials; the search (with its results), or None if the profile failed.
        Tells the service the choice (or that there is none) for the other nodes."""
        mode = self.options.autotune_mode or "run"
        try:
            search = self._search()
        except BaseException as error:
            # Every node stops with this one: a signal's name, or what went wrong here.
            reason = error.sigval.name if isinstance(error, SignalException) else str(error)
            with contextlib.suppress(OSError):  # the trials recorded so far, said to be so
                decisions = [*self.notices, *(self.search.decisions if self.search else [])]
                seconds = time.monotonic() - self.started
                self.report.finish(self.search, decisions, seconds, stopped=reason)
            with contextlib.suppress(ServiceError, TrialRefusedError):
                self.client.stop(self.node.node_rank, reason[:200] or type(error).__name__)
                self._wait_acknowledged(STOP_ACK_WAIT)
            raise
        best = None if search is None else search.best()
        chosen, knobs = None, None
        if search is not None and best is not None:
            ok = [r for r in search.results if r.config == best and r.outcome == OK]
            chosen = max(ok, key=lambda r: r.value(self.metric)).trial
            cap = self.options.autotune_device_memory
            knobs = _knobs(settings_for(run_as(search.results, best), self.pins, cap))
        self.client.finish({"mode": mode, "chosen": chosen, "knobs": knobs})
        self._wait_acknowledged(FINISH_ACK_WAIT)
        return search

    def _wait_acknowledged(self, timeout: float) -> None:
        """Keep the service up until every other node that reported the last trial has seen the
        finish or stop (or ``timeout`` passed: a node that is gone cannot see it)."""
        others = set(range(1, self.nnodes)) & self.answering
        deadline = time.monotonic() + timeout
        while others and time.monotonic() < deadline:
            try:
                if others <= set(self.client.current()["acknowledged"]):
                    return
            except ServiceError:
                return  # nobody can see anything more
            time.sleep(_POLL)

    def _search(self) -> TrialSearch | None:
        where = f" on {self.nnodes} nodes" if self.nnodes > 1 else ""
        self._say(f"level 2 results in {self.results_dir}; trials{where}")
        if self.pins.pinned():
            self._notice(f"pinned (never changed): {self.pins.pinned()}")
        profile = self._trial(0, None, PROFILE, None)
        if profile.outcome != OK:
            self._notice(profile_failed(profile))
            self.report.finish(None, list(self.notices), time.monotonic() - self.started)
            return None
        assert profile.facts is not None
        try:
            space = trial_space(
                self.pins,
                self.world_size,
                profile.config,
                profile.facts,
                self.options.autotune_allow_batch_change,
            )
        except TrialConfigError as error:
            raise OptionError(f"--autotune_level 2: {error}") from None
        untried = space.untried_for_want_of_blocks()
        if untried:
            self._notice(no_blocks_notice(untried))
        if (normed := batch_norm_notice(profile.facts, space, profile.config)) is not None:
            self._notice(normed)
        if profile.facts.get("api") == WRAPPER_API:
            self._notice(
                "the script is measured through distune.DistributedDataParallel (it never calls "
                "distune.prepare): micro-batch x accumulation through arg_mappings, on DDP "
                "without checkpointing"
            )
        only_one = has_one_configuration(space)
        search = TrialSearch(
            space,
            MemoryModel(model_facts(profile.facts, profile.config)),
            self.options.autotune_device_memory,
            self.max_trials,
            self.metric,
        )
        search.record(profile)
        self.search = search
        seen = 0
        while not only_one and (proposal := search.next_trial()) is not None:
            self._run_proposal(search, proposal)
            for decision in search.decisions[seen:]:
                self._say(decision)
            seen = len(search.decisions)
        decisions = [*self.notices, *search.decisions]
        if only_one:
            # A script measured through its wrapper with its mapped knobs pinned: the profile
            # ran the only configuration there is, and measuring it again chooses nothing.
            decisions.append(
                "nothing left to tune: the pins and the script leave one configuration "
                f"({profile.config.describe()}), which the profile trial measured"
            )
            self._say(decisions[-1])
        warning = mapped_flags_failed(search.results, self.pins)
        if warning is not None:
            self._say(warning)
            decisions.append(warning)
        self.report.finish(search, decisions, time.monotonic() - self.started)
        return search

    def _run_proposal(self, search: TrialSearch, proposal: Proposal) -> None:
        profile, flag = search.results[0], self.pins.flag_for(MICRO_BATCH)
        result = self._trial(
            len(search.results),
            proposal.config,
            proposal.purpose,
            proposal.predicted_memory_bytes,
            refuse=lambda ran: batch_moved(profile, ran, flag),
            batch_change=search.space.batch_change(proposal.config),
        )
        moved = batch_moved(profile, result, flag)
        if moved is not None:
            raise OptionError(f"--autotune_level 2: {moved}")
        search.record(result)

    def chosen(self, search: TrialSearch) -> Chosen | None:
        """The winner as ``run`` mode trains it; also writes best_config.json and the command."""
        best = search.best()
        if best is None:
            return None
        as_measured = run_as(search.results, best)
        best_file = self._write_best(best, as_measured is not None)
        self._say(f"chosen: {best.describe()}; {best_file}")
        cap = self.options.autotune_device_memory
        return chosen_run(self.args, self.pins, cap, best.stage, as_measured)

    def untuned(self, config: TrialConfig) -> Chosen:
        """Nothing to tune (:func:`pinned_configuration`): no trial runs; the results name the
        pinned configuration, which ``run`` mode trains with (level 1 inside it)."""
        then = "" if self.options.autotune_mode == "tune" else "training with it; "
        self._say(
            f"nothing to tune: the config pins every level-2 knob ({config.describe()}); no "
            f"trials; {then}results in {self.results_dir}"
        )
        self.report.nothing_to_tune(config)
        self._write_best(config, True)
        cap = self.options.autotune_device_memory
        return chosen_run(self.args, self.pins, cap, config.stage, config)

    def _write_best(self, best: TrialConfig, mapped: bool) -> Path:
        """Write best_config.json (with the config's arg_mappings where ``mapped``: the winner
        runs with its knobs set through them, and the job's own other settings) and
        best_command.txt; the former's path."""
        best_file = self.results_dir / "best_config.json"
        config = {**carried_settings(self.args.autotune_config), **best.to_config(self.world_size)}
        if self.pins.arg_mappings and mapped:
            config["arg_mappings"] = dict(self.pins.arg_mappings)
        best_file.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        command = command_without_tuning(self.argv, self.args, best_file)
        (self.results_dir / "best_command.txt").write_text(shlex.join(command) + "\n")
        return best_file


def pinned_run(
    args: argparse.Namespace, options: AutotuneOptions, pins: TrialPins
) -> argparse.Namespace:
    """Levels 0 and 1 with level-2 keys in the config: the ranks get the pinned knobs (so a
    best_config.json runs the chosen configuration) and mapped flags are rewritten."""
    settings = settings_for(None, pins, options.autotune_device_memory)
    os.environ.update(settings.to_env())
    script_args = rewrite_script_args(
        list(args.training_script_args), pins, pins.micro_batch, pins.accumulation
    )
    return argparse.Namespace(**{**vars(args), "training_script_args": script_args})
