"""``distune status``'s level-2 table of trials, from the trials document alone."""

from __future__ import annotations

from distune.cli.trial_table import format_trials

CONFIG = {
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 1,
    "zero_optimization": {"stage": 0},
    "activation_checkpointing": False,
}


def test_a_failed_profile_shows_the_scripts_own_configuration_not_ones() -> None:
    # Its record holds 1 for each knob nothing told (the script ran its own batch).
    failed = {"trial": 0, "purpose": "profile", "config": CONFIG, "outcome": "crash"}
    table = format_trials({"state": "stopped", "nnodes": 1, "trials": [failed]})
    assert table is not None
    row = table.splitlines()[2].split()
    assert row[:5] == ["0", "profile", "ddp", "script's", "own"]
    search = {**failed, "purpose": "search"}  # a search trial ran what its record says
    table = format_trials({"state": "stopped", "nnodes": 1, "trials": [search]})
    assert table is not None and table.splitlines()[2].split()[3:6] == ["1", "x", "1"]
