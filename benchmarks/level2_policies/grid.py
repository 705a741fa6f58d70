"""Every configuration of a level-2 space, measured as real trials, into one JSON table.

The grid is measured in passes: each pass runs the profile trial (the script's own
configuration) and then every configuration of the space once, the first pass in an order that
interleaves strategies (largest micro-batch first) and each later pass in the reverse of the one
before, so slow drift of a shared machine spreads over all configurations. A row keeps every
pass's trial; its throughput is the mean of the passes that ran ok, its duration the mean of all.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from statistics import mean
from typing import Any, Protocol

from distune.launcher.level2 import model_facts, rewrite_script_args, settings_for
from distune.launcher.options import parse, trial_pins
from distune.launcher.trial_runner import TrialRun
from distune.trial_settings import TrialSettings
from distune.tuning_service.trials.trial_config import STRATEGY_NAMES, TrialConfig
from distune.tuning_service.trials.trial_result import OK
from distune.tuning_service.trials.trial_space import TrialSpace


class Trials(Protocol):
    """Runs one trial of the job (on one node, or on every node of a testbed)."""

    def run(self, index: int, settings: TrialSettings, script_args: list[str]) -> TrialRun:
        """Run trial ``index`` under ``settings`` with the script's rewritten arguments."""
        ...


def pass_row(config: TrialConfig | None, run: TrialRun) -> dict[str, Any]:
    """One pass's trial of a configuration, as the grid stores it."""
    measured = run.measurements or {}
    return {
        "config": None if config is None else list(vars(config).values()),
        "outcome": run.outcome,
        "throughput": measured.get("throughput"),
        "throughput_spread": measured.get("throughput_spread"),
        "step_seconds": measured.get("step_seconds"),
        "peak_memory_bytes": measured.get("peak_memory_bytes"),
        "duration": run.duration,
        "error": run.error,
        "measurements": measured or None,
    }


def merge_passes(passes: list[dict[str, Any]]) -> dict[str, Any]:
    """One configuration's row from its passes: ok if any pass ran ok (memory is the same in
    every pass; a pass that failed otherwise is the machine's doing, and is kept in
    ``passes``), throughput the mean of the ok passes, duration the mean of all."""
    ok = [p for p in passes if p["outcome"] == OK]
    first = ok[0] if ok else passes[0]
    throughputs = [float(p["throughput"]) for p in ok]
    return {
        "config": first["config"],
        "outcome": first["outcome"],
        "throughput": mean(throughputs) if throughputs else None,
        "throughputs": throughputs,
        "step_seconds": mean(float(p["step_seconds"]) for p in ok) if ok else None,
        "peak_memory_bytes": max((p["peak_memory_bytes"] or 0) for p in ok) if ok else None,
        "duration": mean(float(p["duration"]) for p in passes),
        "passes": passes,
    }


def space_order(space: TrialSpace) -> list[TrialConfig]:
    """Every configuration, largest micro-batch first, strategies interleaved."""
    return [
        space.config(stage, checkpointing, micro)
        for micro in reversed(space.micro_batches())
        for checkpointing in space.checkpointing()
        for stage in space.stages()
    ]


def parse_config(text: str) -> TrialConfig:
    """``STRATEGY:MICROxACC[:ckpt][:bf16]`` (``zero3:16x1``, ``ddp:8x2:ckpt``) as a config."""
    parts = text.split(":")
    names = {name: stage for stage, name in STRATEGY_NAMES.items()}
    flags = set(parts[2:])
    try:
        micro, accumulation = (int(n) for n in parts[1].lower().split("x"))
        if parts[0] not in names or not flags <= {"ckpt", "bf16"}:
            raise ValueError
        return TrialConfig(micro, accumulation, names[parts[0]], "ckpt" in flags, "bf16" in flags)
    except (IndexError, ValueError):
        raise ValueError(
            f"{text!r}: expected STRATEGY:MICROxACC[:ckpt][:bf16], STRATEGY one of "
            f"{', '.join(names)}, e.g. zero3:16x1 or ddp:8x2:ckpt"
        ) from None


def load_average() -> list[float]:
    """The machine's 1-, 5- and 15-minute load averages."""
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


class GridMeasurement:
    """The grid of one job, pass by pass, on the trials it is given."""

    def __init__(
        self,
        launcher_argv: list[str],
        trials: Trials,
        world_size: int,
        only: list[TrialConfig] | None = None,
    ) -> None:
        self.launcher_argv = launcher_argv
        #: Measure only these configurations (a noise check), not the whole space.
        self.only = only
        self.args, options = parse(launcher_argv)
        self.pins = trial_pins(self.args)
        self.cap = options.autotune_device_memory
        self.trials = trials
        self.world_size = world_size
        self.index = 0
        self.rows: dict[TrialConfig | None, list[dict[str, Any]]] = {}
        self.profile: TrialConfig | None = None
        self.order: list[TrialConfig] = []
        self.facts: dict[str, Any] | None = None
        self.loads: list[list[float]] = []
        self.started = time.monotonic()

    def _trial(self, config: TrialConfig | None) -> dict[str, Any]:
        settings = settings_for(config, self.pins, self.cap)
        script = rewrite_script_args(
            list(self.args.training_script_args),
            self.pins,
            settings.micro_batch,
            settings.accumulation,
        )
        run = self.trials.run(self.index, settings, script)
        self.index += 1
        row = pass_row(config, run)
        print(f"grid {self.index - 1}: {config} {run.outcome} {row['throughput']}", flush=True)
        return row

    def measure_pass(self) -> None:
        """One pass: the profile, then every configuration (reversed after each pass)."""
        self.loads.append(load_average())
        profile = self._trial(None)
        if self.profile is None:
            if profile["outcome"] != OK:
                raise SystemExit(f"the profile trial ended {profile['outcome']}")
            reported = profile["measurements"]["config"]
            self.profile = TrialConfig(**reported)
            space = TrialSpace(self.pins, self.world_size, self.profile)
            self.order = space_order(space)
            if self.only:
                unknown = [c.describe() for c in self.only if c not in self.order]
                if unknown:
                    raise SystemExit(f"--only: not in the job's space: {'; '.join(unknown)}")
                self.order = [c for c in self.order if c in self.only]
            self.facts = {
                **vars(model_facts(profile["measurements"], self.profile)),
                "profile": list(vars(self.profile).values()),
            }
        else:
            self.order.reverse()
        profile["config"] = list(vars(self.profile).values())
        self.rows.setdefault(None, []).append(profile)
        for config in self.order:
            self.rows.setdefault(config, []).append(self._trial(config))
        self.loads.append(load_average())

    def table(self) -> dict[str, Any]:
        """The grid as JSON: the profile's row first, then every configuration's."""
        assert self.profile is not None and self.facts is not None
        rows = [merge_passes(passes) for passes in self.rows.values()]
        return {
            "command": self.launcher_argv,
            "cap": self.cap,
            "world_size": self.world_size,
            "facts": self.facts,
            "rows": rows,
            "passes": len(self.rows[None]),
            "load_average": self.loads,
            "seconds": time.monotonic() - self.started,
        }


def measure_grid(
    grid: GridMeasurement,
    passes: int,
    between: Callable[[int], None] | None = None,
    save: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Measure ``passes`` passes of the grid; ``between(i)`` runs after pass i (not the last),
    ``save`` gets the table so far after every pass (so a cut-short run keeps its passes)."""
    for index in range(passes):
        grid.measure_pass()
        if save is not None:
            save(grid.table())
        if between is not None and index < passes - 1:
            between(index)
    return grid.table()
