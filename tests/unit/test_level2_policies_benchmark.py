"""The level-2 policy benchmark's replay, on a synthetic grid (no processes)."""

from __future__ import annotations

from benchmarks.level2_policies.policies import (
    Grid,
    compare_table,
    deepspeed_policy,
    distune_policy,
    hand_tuning_policy,
)

from distune.tuning_service.trials.trial_config import TrialConfig, TrialPins
from distune.tuning_service.trials.trial_space import TrialSpace

MiB = 2**20
WORLD = 2
PROFILE = TrialConfig(2, 8, 0, False)
CAP = 300 * MiB


def peak(c: TrialConfig) -> int:
    state = {0: 160, 1: 120, 2: 100, 3: 60}[c.stage] * MiB
    return state + round((3 if c.checkpointing else 10) * MiB * c.micro_batch)


def speed(c: TrialConfig) -> float:
    return (
        100
        * (1 - 0.6 / (1 + c.micro_batch))
        * (1 - 0.05 * c.stage)
        * (0.8 if c.checkpointing else 1)
    )


def row(c: TrialConfig) -> dict:
    ok = peak(c) <= CAP
    return {
        "config": [c.micro_batch, c.accumulation, c.stage, c.checkpointing],
        "outcome": "ok" if ok else "oom",
        "throughput": speed(c) if ok else None,
        "step_seconds": 32 / speed(c) if ok else None,
        "peak_memory_bytes": peak(c) if ok else None,
        "duration": 10.0,
    }


def table() -> dict:
    space = TrialSpace(TrialPins(), WORLD, PROFILE)
    configs = [
        space.config(s, c, m)
        for m in space.micro_batches()
        for c in (False, True)
        for s in range(4)
    ]
    facts = {
        "parameter_bytes": 40 * MiB, "gradient_bytes": 40 * MiB, "optimizer_state_bytes": 80 * MiB,
        "largest_block_bytes": 5 * MiB, "activation_bytes_per_sample": 10 * MiB,
        "profile_peak_bytes": peak(PROFILE), "world_size": WORLD, "checkpointed_bytes_per_sample": 3 * MiB,
        "profile": [2, 8, 0, False],
    }  # fmt: skip
    return {
        "world_size": WORLD,
        "cap": CAP,
        "facts": facts,
        "rows": [row(PROFILE)] + [row(c) for c in configs],
    }


def test_policies_replay_the_grid_and_distune_reaches_its_best_in_fewer_trials() -> None:
    grid = Grid(table())
    best = grid.throughput(grid.best())
    ours, deepspeed, hand = distune_policy(grid), deepspeed_policy(grid), hand_tuning_policy(grid)
    assert grid.throughput(ours.chosen) >= 0.97 * best
    assert ours.trials < len(grid.rows)
    assert {hand.chosen.stage} == {0} and hand.chosen.micro_batch < 16  # DDP cannot reach 16
    assert deepspeed.trials > 1
    assert "| distune |" in compare_table(table())
