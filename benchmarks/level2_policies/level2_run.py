"""A real ``distune-run --autotune_level 2 --autotune_mode tune`` run, side by side with the grid,
and what it ran and chose (read from its ``trials.jsonl`` and ``best_config.json``)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from distune.tuning_service.trials.trial_config import TrialConfig

#: Flags the benchmark sets for the level-2 run itself; the job's arguments may not hold them.
_OWN_FLAGS = ("--autotune_mode", "--autotune_results_dir", "--autotune_resume")


def level2_argv(launcher_argv: list[str], results_dir: Path) -> list[str]:
    """The job's launcher arguments with ``tune`` mode and the results directory added (before
    the training script, where launcher flags go)."""
    for arg in launcher_argv:
        if arg.endswith(".py"):
            break
        if arg.split("=", 1)[0] in _OWN_FLAGS:
            raise SystemExit(f"the benchmark sets {arg.split('=', 1)[0]} itself: leave it out")
    if "--autotune_level" not in launcher_argv:
        raise SystemExit("the job's arguments must run level 2: add --autotune_level 2")
    own = ["--autotune_mode", "tune", "--autotune_results_dir", str(results_dir)]
    return own + launcher_argv


def run_level2_local(launcher_argv: list[str], results_dir: Path, log: Path) -> dict[str, Any]:
    """Run level 2 on this node as a user would; its summary (see :func:`summarize`)."""
    argv = [sys.executable, "-m", "distune.run", *level2_argv(launcher_argv, results_dir)]
    start = time.monotonic()
    with log.open("wb") as out:
        code = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, check=False).returncode
    return summarize(results_dir, time.monotonic() - start, [code])


def summarize(results_dir: Path, wall_seconds: float, exit_codes: list[int]) -> dict[str, Any]:
    """What a level-2 run did: trials, the sum of their durations (as the policies' time is
    counted), its wall time, its choice (None if it chose nothing) and every trial's row."""
    lines = []
    trials_file = results_dir / "trials.jsonl"
    if trials_file.exists():
        lines = [json.loads(x) for x in trials_file.read_text().splitlines() if x.strip()]
    best_file = results_dir / "best_config.json"
    chosen = None
    if best_file.exists():
        config = TrialConfig.from_config(json.loads(best_file.read_text(encoding="utf-8")))
        chosen = list(vars(config).values())
    return {
        "exit_codes": exit_codes,
        "trials": len(lines),
        "seconds": sum(float(x.get("duration") or 0.0) for x in lines),
        "wall_seconds": wall_seconds,
        "chosen": chosen,
        "rows": [
            {
                key: x.get(key)
                for key in (
                    "trial",
                    "purpose",
                    "config",
                    "outcome",
                    "throughput",
                    "peak_memory_bytes",
                    "predicted_memory_bytes",
                    "duration",
                )
            }
            for x in lines
        ],
    }
