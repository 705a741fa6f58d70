"""``distune-run --autotune_level 2`` end to end on CPU: real trials of 2 gloo ranks under a
device memory cap, with an out-of-memory in one rank, a crash, a hang and a Ctrl-C."""

from __future__ import annotations

import json
import shlex
import signal
import time
from pathlib import Path

import pytest

from distune.launcher.options import parse, trial_pins
from tests.e2e.conftest import REPO, SCRIPTS

pytestmark = pytest.mark.slow
WORKER = str(SCRIPTS / "level2_worker.py")


def level2(results: Path, *extra: str) -> list[str]:
    return [
        "--nproc_per_node", "2", "--autotune_level", "2", "--autotune_results_dir", str(results),
        "--autotune_device_memory", "48MiB", *extra,
    ]  # fmt: skip


def trials(results: Path) -> list[dict]:
    return [json.loads(line) for line in (results / "trials.jsonl").read_text().splitlines()]


def test_tune_then_run_prunes_after_an_oom_in_one_rank_and_trains_with_the_winner(launch, tmp_path):
    results = tmp_path / "results"
    argv = level2(results, "--autotune_max_trials", "4", "--autotune_trial_timeout", "60")
    run = launch([*argv, WORKER, "--oom-rank", "1", "--oom-from-micro", "8"])
    assert run.wait(timeout=300) == 0, run.output
    ran = trials(results)
    outcomes = [
        (t["strategy"], t["config"]["train_micro_batch_size_per_gpu"], t["outcome"]) for t in ran
    ]
    # The profile is the script's own 2 x 4; DDP's largest micro-batch (8) runs out of memory in
    # rank 1 only, which prunes it; 4 fits; the faster of 2 and 4 is measured again.
    assert outcomes[:3] == [("ddp", 2, "ok"), ("ddp", 8, "oom"), ("ddp", 4, "ok")]
    assert outcomes[3] in (("ddp", 2, "ok"), ("ddp", 4, "ok"))
    assert [t["purpose"] for t in ran] == ["profile", "search", "search", "remeasure"]
    assert {t["config"]["train_batch_size"] for t in ran} == {16}  # the global batch held
    job = json.loads((results / "job.json").read_text())  # what a resume must match
    assert (job["script"], job["world_size"], job["device_memory"]) == (WORKER, 2, 48 * 2**20)
    assert "over the cap" in ran[1]["error"]
    assert "micro-batches >= 8 of ddp pruned" in run.output
    for trial in ran:
        if trial["outcome"] == "ok":
            assert trial["throughput"] > 0 and 0 < trial["peak_memory_bytes"] <= 48 * 2**20
        if trial["purpose"] != "profile":
            assert trial["predicted_memory_bytes"] > 0
    best = json.loads((results / "best_config.json").read_text())
    args, _ = parse(["--autotune_config", str(results / "best_config.json"), "t.py"])
    assert trial_pins(args).micro_batch == best["train_micro_batch_size_per_gpu"]
    command = (results / "best_command.txt").read_text()
    assert (
        "--autotune_level 0 --autotune_config" in command
        and "--autotune_device_memory" not in command
    )
    again, _ = parse(shlex.split(command)[1:])  # a shell command line that runs the same script
    assert (again.training_script, again.training_script_args[:2]) == (WORKER, ["--oom-rank", "1"])
    summary = (results / "summary.md").read_text()
    micro, accumulation = (
        best["train_micro_batch_size_per_gpu"],
        best["gradient_accumulation_steps"],
    )
    assert "| ddp | 4 | 3 |" in summary
    assert f"**Best:** ddp, micro-batch {micro} x {accumulation}" in summary
    # Mode run: the real training uses the chosen configuration.
    chosen = f"config: ddp {micro} x {accumulation}"
    assert run.output.splitlines().count(chosen) >= 1, run.output
    assert run.leftovers() == []
    # Resuming from these results measures nothing again and chooses the same.
    again = tmp_path / "again"
    argv = level2(again, "--autotune_max_trials", "4", "--autotune_resume", str(results))
    resumed = launch(
        [*argv, "--autotune_mode", "tune", WORKER, "--oom-rank", "1", "--oom-from-micro", "8"]
    )
    assert resumed.wait(timeout=120) == 0, resumed.output
    assert resumed.output.count("(resumed)") == 4
    assert not (again / "trials").exists()  # no trial ran
    assert json.loads((again / "best_config.json").read_text()) == best


def test_a_trial_that_raises_is_a_crash_with_its_traceback_tail(launch, tmp_path):
    results = tmp_path / "results"
    run = launch([*level2(results, "--autotune_mode", "tune"), WORKER, "--crash-stage", "0"])
    assert run.wait(timeout=120) == 1, run.output  # nothing finished: nothing to tune
    (trial,) = trials(results)
    assert trial["outcome"] == "crash"
    assert "ValueError: deliberate failure under ddp" in trial["error"]
    # No training ran under the service: no level-1 summary to mislead ("no model registered").
    assert "no model registered" not in run.output
    assert run.leftovers() == []


def test_a_hanging_trial_is_stopped_by_the_watchdog(launch, tmp_path):
    results = tmp_path / "results"
    run = launch(
        [
            *level2(results, "--autotune_trial_timeout", "4", "--autotune_mode", "tune"),
            WORKER,
            "--hang",
        ]
    )
    assert run.wait(timeout=120) == 1, run.output
    (trial,) = trials(results)
    assert trial["outcome"] == "timeout"
    assert run.leftovers() == []


def test_sigint_during_a_trial_leaves_nothing_behind(launch, tmp_path):
    results = tmp_path / "r"
    run = launch([*level2(results, "--autotune_trial_timeout", "120"), WORKER, "--hang"])
    run.wait_for(r"trial 0/", timeout=60)
    ranks = [results / "trials" / "trial-000" / f"pid.{rank}" for rank in (0, 1)]
    deadline = time.monotonic() + 90
    while not all(p.exists() for p in ranks) and time.monotonic() < deadline:
        time.sleep(0.2)  # until both ranks are in their training loop
    assert all(p.exists() for p in ranks), run.output
    run.process.send_signal(signal.SIGINT)
    assert run.wait(timeout=60) == 128 + signal.SIGINT, run.output
    assert run.leftovers() == []
    # The summary says the run stopped, and what it recorded (here, in its profile: nothing).
    assert (
        (results / "summary.md")
        .read_text()
        .startswith(
            "# distune level 2\n\n**Stopped** (SIGINT) after 0 recorded trial(s), before the "
            "search ended: nothing was chosen; no trial was recorded."
        )
    )


def test_a_script_without_prepare_is_tuned_through_arg_mappings_only(launch, tmp_path):
    # examples/train_mlp.py only wraps its model in distune.DistributedDataParallel; the example
    # config maps its --batch-size and --grad-accum. Its own 2 x 4 on 2 ranks: global batch 16.
    results = tmp_path / "results"
    config = str(REPO / "examples" / "level2_arg_mappings.yaml")
    argv = level2(results, "--autotune_max_trials", "3", "--autotune_mode", "tune")
    mlp = [str(REPO / "examples" / "train_mlp.py"), "--width", "64", "--depth", "2"]
    batch = ["--batch-size", "2", "--grad-accum", "4", "--steps", "50"]
    run = launch([*argv, "--autotune_config", config, *mlp, *batch])
    assert run.wait(timeout=240) == 0, run.output
    assert "measured through distune.DistributedDataParallel" in run.output
    # ... and so does the summary, which lists what the search left out and why.
    assert (
        "measured through distune.DistributedDataParallel" in (results / "summary.md").read_text()
    )
    profile, search, remeasure = trials(results)
    assert remeasure["purpose"] == "remeasure" and remeasure["outcome"] == "ok"
    assert profile["config"] == {  # learned from the wrapper's forwards
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 4,
        "train_batch_size": 16,
        "zero_optimization": {"stage": 0},
        "activation_checkpointing": False,
        "bf16": {"enabled": False},
    }
    assert profile["outcome"] == search["outcome"] == "ok"
    # Only DDP without checkpointing; the global batch held by the largest micro-batch that
    # fits, written into both flags (a script running anything else would end as a crash).
    assert search["config"] == {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 1,
        "train_batch_size": 16,
        "zero_optimization": {"stage": 0},
        "activation_checkpointing": False,
        "bf16": {"enabled": False},
    }
    assert run.leftovers() == []


def test_a_wrapper_script_with_its_mapped_knobs_pinned_is_chosen_from_its_profile(launch, tmp_path):
    # Both mapped knobs pinned: the profile runs the only configuration there is.
    config = tmp_path / "pinned.yaml"
    config.write_text(
        (REPO / "examples" / "level2_arg_mappings.yaml").read_text()
        + "train_micro_batch_size_per_gpu: 4\ngradient_accumulation_steps: 2\n"
    )
    results = tmp_path / "results"
    argv = ["--nproc_per_node", "1", "--autotune_level", "2", "--autotune_mode", "tune",
            "--autotune_results_dir", str(results), "--autotune_config", str(config)]  # fmt: skip
    mlp = [str(REPO / "examples" / "train_mlp.py"), "--width", "32", "--depth", "1"]
    run = launch([*argv, *mlp, "--steps", "40"])
    assert run.wait(timeout=120) == 0, run.output
    assert "nothing left to tune: the pins and the script leave one configuration" in run.output
    (profile,) = trials(results)
    assert profile["outcome"] == "ok"
    assert json.loads((results / "best_config.json").read_text())["train_batch_size"] == 8
