"""Every configuration of a level-2 space, measured as a real trial, into one JSON table."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from distune.launcher.level2 import free_port, model_facts, rewrite_script_args, settings_for
from distune.launcher.options import parse, trial_pins
from distune.launcher.trial_runner import TrialRunner
from distune.tuning_service.trials.trial_config import TrialConfig
from distune.tuning_service.trials.trial_result import OK
from distune.tuning_service.trials.trial_space import TrialSpace


def _row(config: TrialConfig | None, run: Any) -> dict[str, Any]:
    measured = run.measurements or {}
    return {
        "config": None if config is None else list(vars(config).values()),
        "outcome": run.outcome,
        "throughput": measured.get("throughput"),
        "step_seconds": measured.get("step_seconds"),
        "peak_memory_bytes": measured.get("peak_memory_bytes"),
        "duration": run.duration,
        "measurements": measured or None,
    }


def measure_grid(launcher_argv: list[str], out: Path) -> dict[str, Any]:
    """Run the profile trial, then every configuration of the space, once each, in an order
    that interleaves strategies (so slow drift of the machine spreads over all of them)."""
    args, options = parse(launcher_argv)
    pins = trial_pins(args)
    cap = options.autotune_device_memory
    runner = TrialRunner(args, options.autotune_trial_timeout or 120.0, out / "trials")
    started = time.monotonic()

    def trial(index: int, config: TrialConfig | None) -> dict[str, Any]:
        settings = settings_for(config, pins, cap)
        script = rewrite_script_args(
            list(args.training_script_args), pins, settings.micro_batch, settings.accumulation
        )
        run = runner.run(index, settings, script, free_port())
        row = _row(config, run)
        print(f"grid {index}: {config} {run.outcome} {row['throughput']}", flush=True)
        return row

    profile = trial(0, None)
    if profile["outcome"] != OK:
        raise SystemExit(f"the profile trial ended {profile['outcome']}")
    reported = profile["measurements"]["config"]
    baseline = TrialConfig(**reported)
    profile["config"] = list(vars(baseline).values())
    space = TrialSpace(pins, int(profile["measurements"]["world_size"]), baseline)
    configs = [
        space.config(stage, checkpointing, micro)
        for micro in reversed(space.micro_batches())
        for checkpointing in space.checkpointing()
        for stage in space.stages()
    ]
    rows = [profile] + [trial(i + 1, c) for i, c in enumerate(configs)]
    facts = model_facts(profile["measurements"], baseline)
    table = {
        "command": launcher_argv,
        "cap": cap,
        "world_size": space.world_size,
        "facts": {
            **vars(replace(facts, profile=baseline)),
            "profile": list(vars(baseline).values()),
        },
        "rows": rows,
        "seconds": time.monotonic() - started,
    }
    (out / "grid.json").write_text(json.dumps(table, indent=1), encoding="utf-8")
    return table
