"""``distune-run --autotune_level 2 --autotune_mode run`` training a DDP script under ZeRO-3:
rank 0 alone saving the model's state dict (a collective under FSDP) ends the job in seconds,
naming the fix, rather than meet the other ranks' training collectives (a hang until the
process group's 30-minute time-out, or a cryptic abort)."""

from __future__ import annotations

import json
import time

import pytest

from tests.e2e.conftest import SCRIPTS

pytestmark = pytest.mark.slow
SCRIPT = str(SCRIPTS / "rank0_checkpoint.py")
PINS = {  # every knob pinned: no trials, the run starts at once under zero3
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 1,
    "zero_optimization": {"stage": 3},
    "activation_checkpointing": False,
    "bf16": {"enabled": False},
}


def test_a_rank_0_only_save_under_zero3_ends_the_job_in_seconds_naming_the_fix(launch, tmp_path):
    config = tmp_path / "pins.json"
    config.write_text(json.dumps(PINS))
    started = time.monotonic()
    argv = [
        "--nproc_per_node", "2", "--autotune_level", "2", "--autotune_mode", "run",
        "--autotune_config", str(config), "--autotune_results_dir", str(tmp_path / "results"),
        SCRIPT, "--out", str(tmp_path), "--checkpoint-timeout", "3",
    ]  # fmt: skip
    run = launch(argv)
    # Without the check, rank 0's gathers meet rank 1's next forward's: here gloo aborted on
    # their sizes ("Is there a distributed collective mismatch?"); where the sizes match they
    # pair silently, and under NCCL rank 0 can wait until the 30-minute time-out.
    assert run.wait(timeout=60) != 0, run.output
    ended = time.monotonic() - started
    assert "rank 0: training under zero3" in run.output
    assert (
        "CheckpointCallError: distune: run.model.state_dict() under ZeRO stage 3 (FSDP) is a "
        "collective over every rank's shard, and not every rank made the call (waited up to 3 s"
    ) in run.output
    assert "call run.model.state_dict() on every rank" in run.output
    assert "rank 1: done" not in run.output  # rank 1 did not train on alone
    assert not (tmp_path / "model.pt").exists()
    assert ended < 45, ended  # the time-out, the start and the teardown; not 30 minutes
    assert run.leftovers() == []
