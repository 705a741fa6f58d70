"""``distune-run --autotune_level 2``: trials of the user's script, then (mode ``run``) the
real training with the winner.

Order of events: a profile trial runs the script as it is (pinned values applied) and measures
what the memory model needs; then the search (:mod:`distune.tuning_service.trials`) proposes
trials until it is done or ``--autotune_max_trials`` is spent; each trial's record is appended
to ``trials.jsonl`` as it ends; finally ``best_config.json``, ``best_command.txt`` and
``summary.md`` are written. Every value distune chooses is printed as a progress line.
This version runs trials on one node (multi-node trials need the service to coordinate the
nodes' launchers).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from torch.distributed.run import determine_local_world_size, parse_min_max_nnodes

from distune.launcher.options import AutotuneOptions, OptionError, flags
from distune.launcher.trial_report import TrialReport
from distune.launcher.trial_runner import TrialRunner
from distune.trial_settings import TrialSettings
from distune.tuning_service.trials.memory_model import MemoryModel, ModelFacts
from distune.tuning_service.trials.trial_config import (
    ACCUMULATION,
    MICRO_BATCH,
    TrialConfig,
    TrialConfigError,
    TrialPins,
)
from distune.tuning_service.trials.trial_result import CRASH, OK, OOM, THROUGHPUT, TrialResult
from distune.tuning_service.trials.trial_search import Proposal, TrialSearch
from distune.tuning_service.trials.trial_space import TrialSpace

DEFAULT_MAX_TRIALS = 20
DEFAULT_TRIAL_TIMEOUT = 120.0
#: The profile result's ``api`` of a script measured through its DistributedDataParallel.
WRAPPER_API = "wrapper"
_TAKING_PART = (
    " (a script takes part in level 2 by calling distune.prepare, or by wrapping its model in "
    "distune.DistributedDataParallel with its batch flags named in the config's arg_mappings)"
)


@dataclass(frozen=True)
class Chosen:
    """What ``run`` mode trains with: the winner's script arguments and settings."""

    config: TrialConfig
    script_args: list[str]
    settings: TrialSettings


def rewrite_script_args(
    script_args: list[str], pins: TrialPins, micro_batch: int | None, accumulation: int | None
) -> list[str]:
    """The script's arguments with the mapped flags set to the configuration's values.

    Every earlier occurrence of a mapped flag (``--flag V`` or ``--flag=V``) is removed, and the
    flag is appended with the new value, so the script's own parser sees it last.
    """
    values = {MICRO_BATCH: micro_batch, ACCUMULATION: accumulation}
    rewritten = list(script_args)
    for key, flag in pins.arg_mappings:
        value = values.get(key)
        if value is None:
            continue
        kept: list[str] = []
        skip = False
        for arg in rewritten:
            if skip:
                skip = False
            elif arg == flag:
                skip = True
            elif not arg.startswith(f"{flag}="):
                kept.append(arg)
        rewritten = [*kept, flag, str(value)]
    return rewritten


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


def command_without_tuning(argv: list[str], args: argparse.Namespace, best: Path) -> list[str]:
    """The launcher command that runs ``best`` with tuning off: the job's own torchrun flags,
    ``--autotune_level 0 --autotune_config best``, then the script and its arguments."""
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
    return ["distune-run", *kept, "--autotune_level", "0", "--autotune_config", str(best), *rest]


def free_port() -> int:
    """A TCP port nothing listens on now, on loopback (a trial's rendezvous)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _results_dir(options: AutotuneOptions) -> Path:
    if options.autotune_results_dir is None:
        return Path(tempfile.mkdtemp(prefix="distune_level2_"))
    path = options.autotune_results_dir
    path.mkdir(mode=0o700, exist_ok=True)
    if (path / "trials.jsonl").exists() and path != options.autotune_resume:
        raise OptionError(
            f"--autotune_results_dir {path} already holds trials.jsonl; choose another directory "
            "or pass it as --autotune_resume to go on from it"
        )
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


class Level2:
    """One level-2 tuning of one script."""

    def __init__(
        self,
        args: argparse.Namespace,
        options: AutotuneOptions,
        pins: TrialPins,
        argv: list[str],
    ) -> None:
        _, max_nodes = parse_min_max_nnodes(args.nnodes)
        if max_nodes > 1:
            raise OptionError(
                "--autotune_level 2: trials run on one node in this version; tune on one node, "
                "then run the multi-node job with --autotune_config best_config.json"
            )
        self.args = args
        self.options = options
        self.argv = argv
        self.pins = pins
        self.world_size = determine_local_world_size(args.nproc_per_node)
        self.metric = options.autotune_metric or THROUGHPUT
        self.max_trials = options.autotune_max_trials or DEFAULT_MAX_TRIALS
        self.results_dir = _results_dir(options)
        self.report = TrialReport(self.results_dir, self.metric)
        self.runner = TrialRunner(
            args,
            options.autotune_trial_timeout or DEFAULT_TRIAL_TIMEOUT,
            self.results_dir / "trials",
        )
        self.earlier = self._earlier_results()
        if options.autotune_resume == self.results_dir:
            # Resuming in place: the reused trials are written again as they are reused.
            (self.results_dir / "trials.jsonl").unlink()
        self.started = time.monotonic()

    def _earlier_results(self) -> list[TrialResult]:
        if self.options.autotune_resume is None:
            return []
        lines = (self.options.autotune_resume / "trials.jsonl").read_text().splitlines()
        return [TrialResult.from_json(json.loads(line)) for line in lines if line.strip()]

    def _say(self, text: str) -> None:
        if not self.options.autotune_quiet:
            print(f"distune: {text}", flush=True)

    def _trial(
        self, index: int, config: TrialConfig | None, purpose: str, predicted: int | None
    ) -> TrialResult:
        """Run (or, resuming, reuse) one trial and record it."""
        for earlier in self.earlier:
            # The profile is the script's own configuration, whatever it turned out to be.
            same = config is None or earlier.config == config
            if same and earlier.purpose == purpose:
                self.earlier.remove(earlier)
                result = replace(earlier, trial=index)
                self._say(f"trial {index}: {result.config.describe()}: {result.outcome} (resumed)")
                self.report.add(result)
                return result
        what = config.describe() if config is not None else "the script's own configuration"
        predicted_text = f", predicted peak {predicted / 2**20:.1f} MiB" if predicted else ""
        self._say(f"trial {index}/{self.max_trials} ({purpose}): {what}{predicted_text}")
        settings = settings_for(config, self.pins, self.options.autotune_device_memory)
        script_args = rewrite_script_args(
            list(self.args.training_script_args),
            self.pins,
            settings.micro_batch,
            settings.accumulation,
        )
        run = self.runner.run(index, settings, script_args, free_port())
        measured = run.measurements or {}
        if config is None:
            reported = measured.get("config")
            if reported is None:
                config = TrialConfig(
                    self.pins.micro_batch or 1,
                    self.pins.accumulation or 1,
                    self.pins.stage or 0,
                    bool(self.pins.checkpointing),
                    bool(self.pins.bf16),
                )
            else:
                config = TrialConfig(
                    reported["micro_batch"],
                    reported["accumulation"],
                    reported["stage"],
                    reported["checkpointing"],
                    reported.get("bf16", False),
                )
        result = TrialResult(
            trial=index,
            config=config,
            world_size=self.world_size,
            outcome=run.outcome,
            purpose=purpose,
            throughput=measured.get("throughput"),
            throughput_spread=measured.get("throughput_spread"),
            step_seconds=measured.get("step_seconds"),
            peak_memory_bytes=measured.get("peak_memory_bytes"),
            predicted_memory_bytes=predicted,
            duration=run.duration,
            log_path=str(run.log_path),
            error=run.error,
            facts=measured or None,
        )
        self.report.add(result)
        self._say(self.report.line(result))
        return result

    def tune(self) -> TrialSearch | None:
        """Run the trials; the search (with its results), or None if the profile failed."""
        self._say(f"level 2 results in {self.results_dir}")
        if self.pins.pinned():
            self._say(f"pinned (never changed): {self.pins.pinned()}")
        profile = self._trial(0, None, "profile", None)
        if profile.outcome != OK:
            hint = "" if profile.outcome in (OOM, CRASH) else _TAKING_PART
            self._say(
                f"the profile trial (the script's own configuration) ended {profile.outcome}: "
                f"nothing to tune from; see its log{hint}"
            )
            self.report.finish(None, [], time.monotonic() - self.started)
            return None
        assert profile.facts is not None
        try:
            space = TrialSpace(
                space_pins(self.pins, profile.config, profile.facts.get("api")),
                self.world_size,
                profile.config,
                self.options.autotune_allow_batch_change,
            )
        except TrialConfigError as error:
            raise OptionError(f"--autotune_level 2: {error}") from None
        if profile.facts.get("api") == WRAPPER_API:
            self._say(
                "the script is measured through distune.DistributedDataParallel (it never calls "
                "distune.prepare): micro-batch x accumulation through arg_mappings, on DDP "
                "without checkpointing"
            )
        search = TrialSearch(
            space,
            MemoryModel(model_facts(profile.facts, profile.config)),
            self.options.autotune_device_memory,
            self.max_trials,
            self.metric,
        )
        search.record(profile)
        seen = 0
        while (proposal := search.next_trial()) is not None:
            self._run_proposal(search, proposal)
            for decision in search.decisions[seen:]:
                self._say(decision)
            seen = len(search.decisions)
        self.report.finish(search, search.decisions, time.monotonic() - self.started)
        return search

    def _run_proposal(self, search: TrialSearch, proposal: Proposal) -> None:
        result = self._trial(
            len(search.results), proposal.config, proposal.purpose, proposal.predicted_memory_bytes
        )
        change = search.space.batch_change(proposal.config)
        search.record(replace(result, batch_change=change))

    def chosen(self, search: TrialSearch) -> Chosen | None:
        """The winner as ``run`` mode trains it; also writes best_config.json and the command."""
        best = search.best()
        if best is None:
            return None
        best_file = self.results_dir / "best_config.json"
        config = best.to_config(self.world_size)
        if self.pins.arg_mappings:
            config["arg_mappings"] = dict(self.pins.arg_mappings)
        best_file.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        command = command_without_tuning(self.argv, self.args, best_file)
        (self.results_dir / "best_command.txt").write_text(" ".join(command) + "\n")
        settings = settings_for(best, self.pins, self.options.autotune_device_memory)
        script_args = rewrite_script_args(
            list(self.args.training_script_args), self.pins, best.micro_batch, best.accumulation
        )
        self._say(f"chosen: {best.describe()}; {best_file}")
        return Chosen(best, script_args, settings)


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
