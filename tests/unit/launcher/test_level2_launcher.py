"""Level 2's launcher side without processes: outcomes from the ranks' reports, the script's
mapped flags, the command that runs the winner with tuning off, and the level-2 flags."""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

import pytest

from distune.launcher.level2 import (
    command_without_tuning,
    mapped_flags_failed,
    pinned_configuration,
    profile_failed,
    run_as,
)
from distune.launcher.main import main
from distune.launcher.options import parse, trial_pins
from distune.launcher.trial_args import rewrite_script_args, script_batch
from distune.launcher.trial_runner import classify, failed_at, finished_steps, stalled
from distune.tuning_service.trials.trial_config import TrialConfig, TrialPins
from distune.tuning_service.trials.trial_result import TrialResult

OK_RESULT = {"outcome": "ok", "throughput": 10.0}


@pytest.mark.parametrize(
    ("exit_code", "timed_out", "reports", "result", "expected"),
    [
        (0, False, [{"outcome": "ok"}, {"outcome": "ok"}], OK_RESULT, "ok"),
        # One rank ran out of memory; its peer failed in a collective: the trial is oom.
        (
            1,
            False,
            [{"outcome": "crash", "error": "gloo"}, {"outcome": "oom", "error": "OOM"}],
            None,
            "oom",
        ),
        (137, False, [], None, "oom"),
        (1, True, [], None, "timeout"),
        (1, False, [{"outcome": "crash", "error": "ValueError: x"}], None, "crash"),
        (0, False, [], None, "invalid"),
        (1, False, [], None, "crash"),
    ],
)
def test_outcome_comes_from_reports_and_exit_status(
    exit_code, timed_out, reports, result, expected
):
    outcome, _ = classify(exit_code, timed_out, reports, result, "some log")
    assert outcome == expected


def test_the_word_error_in_the_log_does_not_fail_an_ok_trial() -> None:
    assert classify(0, False, [], OK_RESULT, "error: everything is fine")[0] == "ok"


def test_a_crash_carries_the_failing_ranks_traceback_tail() -> None:
    _, error = classify(1, False, [{"outcome": "crash", "error": "ValueError: bad"}], None, "")
    assert error == "ValueError: bad"


def test_of_several_crashed_ranks_the_first_to_fail_is_the_cause() -> None:
    # Rank 1 raised; rank 0 then failed in its all-reduce with it, and sorts first by name.
    peer = {"rank": 0, "outcome": "crash", "error": "RuntimeError: Connection closed by peer"}
    cause = {"rank": 1, "outcome": "crash", "error": "KeyError: 'foo'", "time": 100.0}
    assert classify(1, False, [{**peer, "time": 100.8}, cause], None, "")[1] == "KeyError: 'foo'"
    # A report without a time (an older rank's) never hides one with it.
    assert classify(1, False, [peer, cause], None, "")[1] == "KeyError: 'foo'"
    # The node's report says when its first failure was: the cause's time, not its peer's.
    reports = [{**peer, "time": 100.8}, cause, {"rank": 2, "outcome": "ok", "time": 99.0}]
    assert failed_at("crash", reports, False, Path("/nonexistent")) == 100.0
    assert failed_at("ok", reports, False, Path("/nonexistent")) is None


def test_a_timed_out_trial_says_how_far_it_got_and_names_the_flag() -> None:
    flag = "; --autotune_trial_timeout gives steps more time"
    assert stalled(3, 120.0).startswith("no step finished for 120 s after step 3: ")
    assert stalled(None, 2.5).startswith("no step finished for 2.5 s before the first step: ")
    assert stalled(3, 120.0).endswith(flag)


def test_the_steps_a_trial_finished_are_read_from_its_progress_file(tmp_path: Path) -> None:
    progress = tmp_path / "progress"
    assert finished_steps(progress) is None  # no step yet
    progress.write_text('{"steps": 4}')
    assert finished_steps(progress) == 4
    progress.write_text('{"steps": 4')  # cut short by a rank that died mid-write
    assert finished_steps(progress) is None


def profile(outcome: str, error: str, steps: int | None) -> TrialResult:
    config = TrialConfig(2, 1, 0, False)
    return TrialResult(0, config, 2, outcome, "profile", error=error, steps=steps)


def test_the_profile_tells_how_to_take_part_only_where_the_script_did_not() -> None:
    short = (
        "the script ended after 4 optimizer step(s); a trial runs 7 (2 warm-up, 5 measured): "
        "give it at least 7 in level 2 (its own steps, max_steps or epochs flag)"
    )
    # On two nodes the service prefixes the node that decided the outcome to its error:
    # the script took part all the same.
    assert profile_failed(profile("invalid", f"node 1: {short}", 4)) == (
        "the profile trial (the script's own configuration) ended invalid: nothing to tune "
        "from; see its log"
    )
    never = profile("invalid", "the script ended without finishing the trial's steps", None)
    assert profile_failed(never).endswith(
        "see its log (a script takes part in level 2 by calling distune.prepare, or by "
        "wrapping its model in distune.DistributedDataParallel with its batch flags named in "
        "the config's arg_mappings)"
    )
    assert profile_failed(profile("timeout", "no step finished", 3)).endswith("see its log")
    assert profile_failed(profile("crash", "ValueError", None)).endswith("see its log")
    # Out of memory in the script's own configuration: the ways to a start that fits.
    assert profile_failed(profile("oom", "torch.OutOfMemoryError", 0)).endswith(
        "see its log. Level 2 measures the model in the script's own configuration first, so "
        "that one must fit: give the script a smaller micro-batch with more accumulation steps "
        "(the same global batch), or pin a configuration that saves memory in --autotune_config "
        "(zero_optimization: {stage: 3}, activation_checkpointing: true; the search then keeps "
        "what is pinned), or, with --autotune_device_memory, a larger cap"
    )


def test_mapped_flags_are_rewritten_in_both_spellings() -> None:
    pins = TrialPins(
        arg_mappings=(
            ("gradient_accumulation_steps", "--accum"),
            ("train_micro_batch_size_per_gpu", "--bs"),
        )
    )
    args = ["--bs", "4", "--lr", "0.1", "--accum=2", "--steps", "10"]
    assert rewrite_script_args(args, pins, 8, 1) == [
        "--bs", "8", "--lr", "0.1", "--accum", "1", "--steps", "10",
    ]  # fmt: skip
    assert rewrite_script_args(args, TrialPins(), 8, 1) == args  # unmapped: left alone
    # Given twice, the last occurrence takes the value and the earlier one goes; a flag the
    # arguments do not give is appended.
    assert rewrite_script_args(["--bs", "2", "--lr", "1", "--bs=4"], pins, 8, 1) == [
        "--lr", "1", "--bs", "8", "--accum", "1",
    ]  # fmt: skip


def test_mapped_flags_keep_their_place_before_a_subcommand() -> None:
    # `train.py --bs 4 --accum 2 fit`: the main parser's flags must stay before the
    # subcommand, whose own parser refuses them (`unrecognized arguments: --accum 2 --bs 4`,
    # which ended the profile trial, and so the tuning, when they were moved to the end).
    parser = argparse.ArgumentParser()
    parser.add_argument("--bs", type=int)
    parser.add_argument("--accum", type=int)
    parser.add_subparsers(dest="command").add_parser("fit").add_argument("--steps", type=int)
    pins = TrialPins(
        arg_mappings=(
            ("gradient_accumulation_steps", "--accum"),
            ("train_micro_batch_size_per_gpu", "--bs"),
        )
    )
    own = ["--bs", "4", "--accum", "2", "fit", "--steps", "9"]
    assert rewrite_script_args(own, pins, 4, 2) == own  # the profile runs them as given
    parsed = parser.parse_args(rewrite_script_args(own, pins, 8, 1))
    assert (parsed.bs, parsed.accum, parsed.command, parsed.steps) == (8, 1, "fit", 9)


def test_the_profile_is_told_the_batch_the_scripts_own_mapped_flags_give() -> None:
    mapped = (
        ("gradient_accumulation_steps", "--accum"),
        ("train_micro_batch_size_per_gpu", "--bs"),
    )
    # The last occurrence wins, as with argparse; both spellings.
    own = script_batch(
        ["--bs", "4", "--accum=2", "--bs=20", "--steps", "3"], TrialPins(arg_mappings=mapped)
    )
    assert (own.micro_batch, own.accumulation) == (20, 2)
    # A pin wins; a flag the arguments leave to the script's default, or give no count, is untold.
    pinned = TrialPins(micro_batch=8, arg_mappings=mapped)
    assert script_batch(["--bs", "4", "--accum", "x"], pinned).micro_batch == 8
    assert script_batch(["--bs", "4", "--accum", "x"], pinned).accumulation is None
    assert (
        script_batch(["--steps", "3", "--bs"], TrialPins(arg_mappings=mapped)).micro_batch is None
    )
    assert script_batch(["--bs", "4"], TrialPins()) == TrialPins()  # unmapped: nothing told


def test_a_script_given_no_arguments_is_profiled_with_its_own_defaults() -> None:
    # `distune-run ... train.py` with arg_mappings in the config: the launcher used to fail
    # with a ValueError from zip() before the profile trial started.
    pins = TrialPins(arg_mappings=(("train_micro_batch_size_per_gpu", "--bs"),))
    assert script_batch([], pins) == pins
    assert rewrite_script_args([], pins, 8, 1) == ["--bs", "8"]


def test_the_best_command_keeps_torchrun_flags_and_turns_tuning_off() -> None:
    argv = [
        "--nproc_per_node",
        "2",
        "--autotune_level",
        "2",
        "--autotune-device-memory=1GiB",
        "--autotune_allow_batch_change",
        "--autotune_max_trials",
        "5",
        "train.py",
        "--autotune_level",
        "7",
    ]
    args, _ = parse(argv)
    command = command_without_tuning(argv, args, Path("/r/best_config.json"))
    assert command == [
        "distune-run",
        "--autotune_level",
        "0",
        "--autotune_config",
        "/r/best_config.json",
        "--nproc_per_node",
        "2",
        "train.py",
        "--autotune_level",
        "7",
    ]


def test_the_best_config_keeps_the_jobs_own_settings_from_its_config_file(tmp_path) -> None:
    from distune.launcher.level2 import Level2
    from distune.launcher.trial_client import TrialClient

    # A pinned bucket size in the config file: the run after the trials uses it, and so must
    # best_command.txt, which replaces that file with best_config.json (it used to drop it).
    config = tmp_path / "job.yaml"
    config.write_text(
        "bucket_size: 1048576\nhierarchical_reduce: false\nautotune_max_trials: 5\n"
        "train_micro_batch_size_per_gpu: 4\ngradient_accumulation_steps: 2\n"
        "zero_optimization: {stage: 1}\nactivation_checkpointing: false\n"
    )
    argv = ["--nproc_per_node", "2", "--autotune_level", "2", "--autotune_results_dir",
            str(tmp_path / "results"), "--autotune_config", str(config), "t.py"]  # fmt: skip
    args, options = parse(argv)
    level2 = Level2(args, options, trial_pins(args), argv, TrialClient("http://127.0.0.1:9"))
    level2.untuned(TrialConfig(4, 2, 1, False))
    best = tmp_path / "results" / "best_config.json"
    written = json.loads(best.read_text())
    assert (written["bucket_size"], written["hierarchical_reduce"]) == (1048576, False)
    assert "autotune_max_trials" not in written  # the tuning's own settings stay behind
    again, options = parse(shlex.split((best.parent / "best_command.txt").read_text())[1:])
    assert (options.bucket_size, options.hierarchical_reduce) == (1048576, False)
    assert trial_pins(again).stage == 1


@pytest.mark.parametrize(
    "launcher",
    [
        ["--nproc_per_node", "2", "--autotune_level", "2", "--"],  # the script after a --
        ["--nproc_per_node", "2", "--autotune_level=2", "-m"],  # a module
        ["--no-python", "--autotune-level", "2", "--autotune_config", "CONFIG"],
    ],
)
def test_the_best_command_runs_the_same_script_with_tuning_off(launcher, tmp_path) -> None:
    best = tmp_path / "best config.json"
    best.write_text("{}")
    launcher = [str(best) if arg == "CONFIG" else arg for arg in launcher]
    argv = [*launcher, "train.py", "--message", "two words", "--autotune_level", "1"]
    args, _ = parse(argv)
    command = command_without_tuning(argv, args, best)
    again, options = parse(command[1:])
    assert (again.training_script, again.training_script_args) == (
        args.training_script,
        args.training_script_args,
    )
    assert (again.module, again.no_python) == (args.module, args.no_python)
    assert (options.autotune_level, again.autotune_config) == (0, str(best))


def test_level2_flags_and_config_keys(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(
        "zero_optimization: {stage: 1}\narg_mappings: {train_micro_batch_size_per_gpu: --bs}\n"
    )
    args, options = parse(
        [
            "--autotune_level",
            "2",
            "--autotune_device_memory",
            "512MiB",
            "--autotune_metric",
            "latency",
            "--autotune_config",
            str(config),
            "t.py",
        ]
    )
    assert options.autotune_device_memory == 512 * 2**20
    assert options.autotune_metric == "latency"
    assert trial_pins(args).stage == 1
    assert trial_pins(args).flag_for("train_micro_batch_size_per_gpu") == "--bs"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--autotune_device_memory", "lots"],
            "must be a number of bytes like 536870912, 512MiB or 2GiB",
        ),
        (["--autotune_metric", "speed"], "must be one of throughput, latency"),
        (["--autotune_mode", "dry"], "must be one of tune, run"),
        (["--autotune_max_trials", "1"], "must be an integer of at least 2"),
        (["--autotune_resume", "/nonexistent/x"], "does not exist"),
    ],
)
def test_bad_level2_flags_exit_2_naming_the_flag(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse([*argv, "t.py"])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}},
            "zero_optimization takes only stage (ddp, torch's ZeroRedundancyOptimizer or FSDP), "
            "got offload_param: DeepSpeed's other ZeRO options, CPU or NVMe offload among them",
        ),
        (
            {"arg_mappings": {"train_micro_batch_size_per_gpu": "--bs",
                              "gradient_accumulation_steps": "--bs"}},
            "arg_mappings: gradient_accumulation_steps and train_micro_batch_size_per_gpu map to "
            "the same flag "
            "--bs; each needs a flag of its own",
        ),
        ({"train_batch_size": "all"}, "train_batch_size must be a whole number of at least 1"),
        # The pinned batch cannot be kept on 2 ranks: said before the profile trial, with what can.
        (
            {"train_batch_size": 31},
            "train_batch_size 31 does not divide among 2 ranks; the nearest that do: 30 or 32",
        ),
        (
            {"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4},
            "no micro-batch x accumulation gives train_batch_size 30 on 2 ranks with the pinned "
            "values {'train_micro_batch_size_per_gpu': 4, 'train_batch_size': 30}: each rank's "
            "15 samples split only as 1 x 15, 3 x 5, 5 x 3, 15 x 1; unpin one or pass "
            "--autotune_allow_batch_change",
        ),
        (
            {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
             "gradient_accumulation_steps": 2},
            "train_batch_size 32 is not train_micro_batch_size_per_gpu 4 x "
            "gradient_accumulation_steps 2 x 2 ranks",
        ),
    ],
)  # fmt: skip
def test_bad_deepspeed_style_keys_exit_2_before_anything_starts(
    tmp_path, config, message, capsys
) -> None:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    argv = ["--nproc_per_node", "2", "--autotune_level", "2", "--autotune_config", str(path)]
    assert main([*argv, "t.py"]) == 2
    out, err = capsys.readouterr()
    assert err.startswith(f"distune-run: error: --autotune_config: {message}")
    assert err.count("\n") == 1
    assert "tuning service" not in out  # refused before the service started


@pytest.mark.parametrize("level", ["0", "1"])
def test_a_best_config_run_on_other_ranks_than_it_was_tuned_on_is_refused(
    tmp_path, level, capsys
) -> None:
    best = TrialConfig(8, 1, 0, False).to_config(2)  # tuned on 2 ranks: global batch 16
    path = tmp_path / "best_config.json"
    path.write_text(json.dumps(best))
    argv = ["--nproc_per_node", "4", "--autotune_level", level, "--autotune_config", str(path)]
    assert main([*argv, "t.py"]) == 2
    assert capsys.readouterr().err == (
        "distune-run: error: --autotune_config: train_batch_size 16 is not "
        "train_micro_batch_size_per_gpu 8 x gradient_accumulation_steps 1 x 4 ranks\n"
    )


def test_auto_batch_keys_of_a_trainer_deepspeed_config_are_distunes_to_choose(tmp_path) -> None:
    path = tmp_path / "ds_config.json"
    auto = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto", "zero_optimization": {"stage": 2}}  # fmt: skip
    path.write_text(json.dumps(auto))
    args, _ = parse(["--autotune_level", "2", "--autotune_config", str(path), "t.py"])
    assert trial_pins(args).pinned() == {"zero_optimization": {"stage": 2}}


def test_the_arg_mappings_example_config_is_valid() -> None:
    example = Path(__file__).resolve().parents[3] / "examples" / "level2_arg_mappings.yaml"
    args, _ = parse(["--autotune_level", "2", "--autotune_config", str(example), "t.py"])
    pins = trial_pins(args)
    assert pins.global_batch is None  # the script's own global batch is kept
    assert rewrite_script_args(["--batch-size", "2"], pins, 8, 2) == [
        "--batch-size", "8", "--grad-accum", "2",
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--nnodes", "1:2", "--rdzv_backend", "c10d", "--rdzv_endpoint", "h:29400"],
            r"--nnodes 1:2: trials need a fixed number of nodes",
        ),
        (
            ["--nnodes", "2", "--rdzv_backend", "c10d", "--rdzv_endpoint", "h:29400"],
            r"uses static rendezvous .* got --rdzv_backend c10d with --rdzv_endpoint",
        ),
    ],
)
def test_level2_on_several_nodes_refuses_what_trials_cannot_coordinate(flags, message) -> None:
    from distune.launcher.level2 import trial_world
    from distune.launcher.options import OptionError

    args, _ = parse([*flags, "--nproc_per_node", "2", "--autotune_level", "2", "t.py"])
    with pytest.raises(OptionError, match=message):
        trial_world(args)


def test_level2_counts_every_node_in_the_trials_world() -> None:
    from distune.launcher.level2 import trial_world

    argv = ["--nnodes", "2", "--nproc_per_node", "3", "--master_addr", "10.0.0.1"]
    args, _ = parse([*argv, "--autotune_level", "2", "t.py"])
    assert trial_world(args) == (2, 6)
    args, _ = parse(["--nproc_per_node", "3", "--autotune_level", "2", "t.py"])
    assert trial_world(args) == (1, 3)


def test_level2_refuses_a_results_dir_already_used(tmp_path: Path) -> None:
    from distune.launcher.level2 import Level2
    from distune.launcher.options import OptionError
    from distune.launcher.trial_client import TrialClient

    used = tmp_path / "results"
    used.mkdir()
    (used / "trials.jsonl").write_text("")
    argv = [
        "--nproc_per_node",
        "2",
        "--autotune_level",
        "2",
        "--autotune_results_dir",
        str(used),
        "t.py",
    ]
    args, options = parse(argv)
    with pytest.raises(OptionError, match=r"already holds trials\.jsonl"):
        Level2(args, options, TrialPins(), argv, TrialClient("http://127.0.0.1:9"))


def test_a_used_results_dir_is_refused_before_anything_starts_unless_resumed_in_place(
    tmp_path: Path, capsys
) -> None:
    from distune.launcher.level2 import check_results_dir
    from distune.launcher.options import OptionError

    used = tmp_path / "results"
    used.mkdir()
    (used / "trials.jsonl").write_text("")
    (tmp_path / "elsewhere").mkdir()
    argv = ["--nproc_per_node", "2", "--autotune_level", "2", "--autotune_results_dir", str(used)]
    assert main([*argv, "t.py"]) == 2
    out, err = capsys.readouterr()
    assert "already holds trials.jsonl" in err and "tuning service" not in out
    # The same directory spelled another way is resumed in place.
    again = tmp_path / "elsewhere" / ".." / "results"
    _, options = parse([*argv, "--autotune_resume", str(again), "t.py"])
    check_results_dir(options)
    # A run still at its first trial (job.json, no trials.jsonl yet) is not joined by another.
    running = tmp_path / "running"
    running.mkdir()
    (running / "job.json").write_text("{}")
    _, options = parse([*argv[:-1], str(running), "t.py"])
    with pytest.raises(OptionError, match=r"already holds job\.json of a level-2 run") as refused:
        check_results_dir(options)
    # Nor told to resume it (a run stopped during its profile trial): with no trials.jsonl,
    # --autotune_resume refuses it; what to do instead is named.
    assert "--autotune_resume" not in str(refused.value)
    assert str(refused.value).endswith(f"delete {running / 'job.json'} if no run uses it")
    with pytest.raises(SystemExit):
        parse([*argv[:-1], str(running), "--autotune_resume", str(running), "t.py"])
    assert "holds no trials.jsonl" in capsys.readouterr().err


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_a_results_dir_that_cannot_be_made_is_an_option_error() -> None:
    from distune.launcher.level2 import Level2
    from distune.launcher.options import OptionError
    from distune.launcher.trial_client import TrialClient

    argv = ["--autotune_level", "2", "--autotune_results_dir", "/proc/distune_results", "t.py"]
    args, options = parse(argv)
    with pytest.raises(OptionError, match=r"^--autotune_results_dir /proc/distune_results: "):
        Level2(args, options, TrialPins(), argv, TrialClient("http://127.0.0.1:9"))


def test_node_0_refuses_a_master_addr_it_cannot_listen_at() -> None:
    from distune.launcher.level2 import trial_port
    from distune.launcher.options import OptionError

    argv = ["--nnodes", "2", "--node_rank", "0", "--master_addr", "192.0.2.1"]  # TEST-NET-1
    args, _ = parse([*argv, "--autotune_level", "2", "t.py"])
    with pytest.raises(OptionError, match=r"--master_addr 192\.0\.2\.1: node 0 cannot listen"):
        trial_port(args)
    args, _ = parse(
        ["--nnodes", "2", "--master_addr", "127.0.0.1", "--autotune_level", "2", "t.py"]
    )
    assert 0 < trial_port(args) < 65536


def test_a_script_measured_through_its_wrapper_keeps_ddp_and_its_unmapped_knobs() -> None:
    from distune.launcher.level2 import space_pins
    from distune.tuning_service.trials.trial_config import TrialConfig, TrialConfigError

    own = TrialConfig(2, 4, 0, False)
    mapped = TrialPins(arg_mappings=(("train_micro_batch_size_per_gpu", "--batch-size"),))
    assert space_pins(mapped, own, "prepare") == mapped  # prepare: everything stays free
    # Only the micro-batch flag is mapped: the accumulation stays the script's own.
    assert space_pins(mapped, own, "wrapper") == TrialPins(
        accumulation=4, stage=0, checkpointing=False, arg_mappings=mapped.arg_mappings
    )
    with pytest.raises(TrialConfigError, match=r"never calls distune\.prepare and the config has"):
        space_pins(TrialPins(), own, "wrapper")
    with pytest.raises(TrialConfigError, match=r"need the script to call distune\.prepare"):
        space_pins(TrialPins(stage=2, arg_mappings=mapped.arg_mappings), own, "wrapper")


def test_a_model_without_repeated_blocks_is_not_tried_with_zero3_or_checkpointing() -> None:
    from distune.launcher.level2 import trial_space
    from distune.tuning_service.trials.trial_config import TrialConfig

    own = TrialConfig(2, 4, 0, False)
    flat = {"api": "prepare", "repeated_block_classes": 0}
    space = trial_space(TrialPins(), 2, own, flat, False)
    assert (space.stages(), space.checkpointing()) == ((0, 1, 2), (False,))
    assert not space.contains(TrialConfig(2, 4, 3, False))
    blocks = trial_space(TrialPins(), 2, own, {**flat, "repeated_block_classes": 1}, False)
    assert (blocks.stages(), blocks.checkpointing()) == ((0, 1, 2, 3), (False, True))
    # A profile recorded before the fact (a resumed trials.jsonl) keeps every strategy.
    assert trial_space(TrialPins(), 2, own, {"api": "prepare"}, False).stages() == (0, 1, 2, 3)
    # What the user pins stays pinned (a pinned ZeRO-3 without blocks crashes naming them).
    pinned = trial_space(TrialPins(stage=3, checkpointing=True), 2, own, flat, False)
    assert (pinned.stages(), pinned.checkpointing()) == ((3,), (True,))


def test_the_no_blocks_notice_names_only_the_knobs_the_missing_blocks_took_out() -> None:
    from distune.launcher.level2 import no_blocks_notice, trial_space
    from distune.tuning_service.trials.trial_config import TrialConfig

    own = TrialConfig(2, 4, 0, False)
    flat = {"api": "prepare", "repeated_block_classes": 0}

    def untried(pins: TrialPins, facts: dict[str, object]) -> tuple[str, ...]:
        return trial_space(pins, 2, own, facts, False).untried_for_want_of_blocks()

    assert untried(TrialPins(), flat) == ("ZeRO-3", "activation checkpointing")
    assert untried(TrialPins(stage=1), flat) == ("activation checkpointing",)
    assert untried(TrialPins(checkpointing=False), flat) == ("ZeRO-3",)
    # Nothing lost: both pinned, blocks found, or the wrapper path (DDP, no checkpointing).
    assert untried(TrialPins(stage=2, checkpointing=False), flat) == ()
    assert untried(TrialPins(), {**flat, "repeated_block_classes": 2}) == ()
    mapped = TrialPins(arg_mappings=(("train_micro_batch_size_per_gpu", "--batch-size"),))
    assert untried(mapped, {**flat, "api": "wrapper"}) == ()
    assert "so ZeRO-3 are" not in no_blocks_notice(("ZeRO-3",))
    assert "so activation checkpointing is not tried" in no_blocks_notice(
        ("activation checkpointing",)
    )


def test_a_best_config_in_bf16_reaches_the_ranks_and_auto_profiles_in_full_precision(
    tmp_path: Path,
) -> None:
    from distune.launcher.level2 import settings_for
    from distune.trial_settings import BF16
    from distune.tuning_service.trials.trial_config import TrialConfig

    best = TrialConfig(8, 2, 1, False, bf16=True)
    path = tmp_path / "best_config.json"
    path.write_text(json.dumps(best.to_config(2)))
    args, _ = parse(["--autotune_level", "0", "--autotune_config", str(path), "t.py"])
    pins = trial_pins(args)
    assert pins.bf16 is True
    assert settings_for(None, pins, None).to_env()[BF16] == "1"  # levels 0/1 run it in bf16
    assert settings_for(best, TrialPins(bf16=None), None).to_env()[BF16] == "1"
    # bf16 allowed (auto): the profile runs the script's own numerics, full precision.
    assert BF16 not in settings_for(None, TrialPins(bf16=None), None).to_env()


def _ran(trial: int, config: TrialConfig, outcome: str, purpose: str = "search") -> TrialResult:
    measured = {"throughput": 10.0, "step_seconds": 1.0} if outcome == "ok" else {}
    error = None if outcome == "ok" else "train.py: error: unrecognized arguments: --bs 8"
    return TrialResult(trial, config, 2, outcome, purpose, error=error, **measured)


def test_a_winner_only_the_profile_ran_ok_runs_as_the_profile_ran_and_the_user_is_told() -> None:
    own, larger = TrialConfig(2, 4, 0, False), TrialConfig(8, 1, 0, False)
    pins = TrialPins(arg_mappings=(("train_micro_batch_size_per_gpu", "--bs"),))
    # Every trial that set --bs crashed (the script takes no such flag); the profile ran.
    results = [_ran(0, own, "ok", "profile"), _ran(1, larger, "crash"), _ran(2, own, "crash")]
    assert run_as(results, own) is None  # the script's own arguments, not --bs 2
    warning = mapped_flags_failed(results, pins)
    assert warning is not None
    assert warning.startswith("no trial that set --bs (the config's arg_mappings) ended ok")
    assert "trial 1, ended crash (train.py: error: unrecognized arguments: --bs 8)" in warning
    # A winner a trial with its knobs measured runs with them; then nothing to tell.
    results.append(_ran(3, larger, "ok"))
    assert run_as(results, larger) == larger
    assert mapped_flags_failed(results, pins) is None
    assert mapped_flags_failed(results[:3], TrialPins()) is None  # nothing was mapped


PINNED = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
          "zero_optimization": {"stage": 1}, "activation_checkpointing": False}  # fmt: skip


@pytest.mark.parametrize(
    ("config", "allow_batch_change", "expected"),
    [
        (PINNED, False, TrialConfig(4, 2, 1, False)),
        # The accumulation follows from a pinned global batch, unless the batch may change.
        ({**PINNED, "gradient_accumulation_steps": "auto", "train_batch_size": 16}, False,
         TrialConfig(4, 2, 1, False)),
        ({**PINNED, "gradient_accumulation_steps": "auto", "train_batch_size": 16}, True, None),
        ({k: v for k, v in PINNED.items() if k != "zero_optimization"}, False, None),
        ({**PINNED, "bf16": {"enabled": "auto"}}, False, None),
        ({**PINNED, "bf16": {"enabled": True}}, False, TrialConfig(4, 2, 1, False, True)),
        ({k: v for k, v in PINNED.items() if k != "activation_checkpointing"}, False, None),
    ],
)  # fmt: skip
def test_nothing_is_left_to_tune_only_where_the_pins_fix_every_knob(
    config, allow_batch_change, expected
) -> None:
    assert pinned_configuration(TrialPins.from_config(config), 2, allow_batch_change) == expected


def test_with_every_knob_pinned_level_2_runs_no_trial_and_writes_that_configuration(
    tmp_path, capsys
) -> None:
    path = tmp_path / "best_config.json"
    path.write_text(json.dumps(TrialConfig(4, 2, 1, False).to_config(2)))
    script = tmp_path / "t.py"
    script.write_text("raise SystemExit(3)\n")  # no trial may run it
    results = tmp_path / "results"
    argv = ["--nproc_per_node", "2", "--autotune_level", "2", "--autotune_mode", "tune",
            "--autotune_config", str(path), "--autotune_results_dir", str(results)]  # fmt: skip
    assert main([*argv, str(script)]) == 0
    out = capsys.readouterr().out
    assert (
        "nothing to tune: the config pins every level-2 knob (zero1, micro-batch 4 x 2); no "
        f"trials; results in {results}"
    ) in out
    assert "trial 0" not in out
    assert json.loads((results / "best_config.json").read_text()) == json.loads(path.read_text())
    assert "Nothing to tune" in (results / "summary.md").read_text()
    assert not (results / "trials.jsonl").exists()
    command = (results / "best_command.txt").read_text()
    assert "--autotune_level 0 --autotune_config" in command


def test_a_trial_finding_the_batch_in_another_dimension_than_the_profile_stops_the_search() -> None:
    from distune.launcher.level2 import batch_moved

    def ran(trial: int, micro: int, dimensions: list[int]) -> TrialResult:
        facts = {"api": "wrapper", "batch_dimensions": dimensions}
        config = TrialConfig(micro, 1, 0, False)
        return TrialResult(
            trial, config, 2, "ok", "search", throughput=1.0, step_seconds=1.0, facts=facts
        )

    # An LSTM's (35 time steps, batch) input, its --batch_size left to the script's default:
    # the profile read the 35 time steps; a trial told 10 finds it in dimension 1.
    profile = ran(0, 35, [0])
    moved = batch_moved(profile, ran(1, 10, [1]), "--batch_size")
    assert moved is not None
    assert moved.startswith("trial 1 found its micro-batch (10) in dimension 1 of the script's")
    assert moved.endswith("give --batch_size on the command line (the profile then looks for its "
                          "value in every dimension)")  # fmt: skip
    assert batch_moved(profile, ran(2, 35, [0, 1]), "--batch_size") is None  # (35, 35): agrees
    assert batch_moved(ran(0, 20, [1]), ran(1, 10, [1]), "--batch_size") is None  # told: agrees
    assert batch_moved(_ran(0, TrialConfig(2, 4, 0, False), "ok", "profile"), profile, None) is None


def test_a_prepare_trial_holding_its_micro_batch_elsewhere_than_the_profile_is_refused() -> None:
    from distune.launcher.level2 import batch_moved

    def ran(trial: int, micro: int, dimensions: list[int]) -> TrialResult:
        facts = {"api": "prepare", "batch_dimensions": dimensions}
        return TrialResult(
            trial, TrialConfig(micro, 1, 0, False), 2, "ok", "search", throughput=1.0,
            step_seconds=1.0, facts=facts,
        )  # fmt: skip

    # Its own 4 samples of 32 features, (4, 32), in the profile and in a trial set to 32: the
    # trial would be measured as 32 samples a forward (8 x the throughput, and chosen).
    moved = batch_moved(ran(0, 4, [0]), ran(1, 32, [1]), None)
    assert moved is not None and moved.startswith(
        "trial 1: distune.prepare set the micro-batch to 32, which the script's first input "
        "holds only in dimension 1, but the profile trial's micro-batch (4) was in dimension 0"
    )
    assert moved.endswith("build each micro-batch with run.micro_batch_size samples")
    assert batch_moved(ran(0, 4, [0]), ran(1, 32, [0, 1]), None) is None  # (32, 32): built so
    assert batch_moved(ran(0, 4, [1]), ran(1, 8, [1]), None) is None  # sequence-first, (35, 8)


def test_a_model_with_batch_norms_is_told_that_the_micro_batch_changes_their_statistics() -> None:
    from torch import nn

    from distune.launcher.level2 import batch_norm_notice
    from distune.tuning_service.trials.trial_space import TrialSpace
    from distune.worker_runtime.trial_measurement import batch_norms

    resnet_ish = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.BatchNorm2d(8))
    assert batch_norms(resnet_ish) == 2  # what the profile trial reports as `batch_norms`
    own = TrialConfig(16, 1, 0, False)
    space = TrialSpace(TrialPins(), 2, own)
    assert batch_norm_notice({"batch_norms": 2}, space, own) == (
        "the model has 2 batch norms: their statistics are over each micro-batch, so a trial at "
        "another micro-batch than the script's own (16) trains with other statistics (the same "
        "global batch, not the same math); pin train_micro_batch_size_per_gpu: 16 in "
        "--autotune_config to keep it"
    )
    pinned = TrialSpace(TrialPins(micro_batch=16), 2, own)
    assert batch_norm_notice({"batch_norms": 2}, pinned, own) is None  # nothing to change
    assert batch_norm_notice({"batch_norms": 0}, space, own) is None
    assert batch_norm_notice({}, space, own) is None  # a profile of an earlier version
