"""distune-run's flags: torchrun's pass through, autotune flags validated, config files merged."""

import json
import os
from pathlib import Path

import pytest
import torch

from distune.launcher.config_file import load_config
from distune.launcher.main import main
from distune.launcher.options import (
    AutotuneOptions,
    check_training_script,
    parse,
    unused_tuning_flags,
)
from distune.launcher.plan import plan_launch


def test_torchrun_flags_pass_through_with_both_spellings():
    args, options = parse(["--nproc-per-node", "2", "--max_restarts", "3", "train.py", "--lr", "1"])
    assert args.nproc_per_node == "2"
    assert args.max_restarts == 3
    assert args.training_script == "train.py"
    assert args.training_script_args == ["--lr", "1"]
    assert options == AutotuneOptions()


def test_valid_torchrun_output_and_rendezvous_flags_pass_and_script_flags_stay_its_own(tmp_path):
    args, options = parse(
        [
            "--tee", "0:1,1:2", "--redirects", "3", "--log-dir", str(tmp_path / "new" / "logs"),
            "--local-ranks-filter", "0,1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", "localhost:29400", "-m", "pkg.train",
            "--autotune_level", "2", "--nproc_per_node", "3", "--", "--tee", "x",
        ]
    )  # fmt: skip
    assert (args.tee, args.redirects, args.local_ranks_filter) == ("0:1,1:2", "3", "0,1")
    assert args.module and args.training_script == "pkg.train"
    assert args.training_script_args == [
        "--autotune_level", "2", "--nproc_per_node", "3", "--", "--tee", "x"
    ]  # fmt: skip
    assert options == AutotuneOptions()


def test_torchrun_pet_environment_fallback(monkeypatch):
    monkeypatch.setenv("PET_NPROC_PER_NODE", "4")
    args, _ = parse(["train.py"])
    assert args.nproc_per_node == "4"


def test_autotune_flags_in_both_spellings():
    _, options = parse(
        [
            "--autotune-level", "1",
            "--autotune_max_samples", "12",
            "--autotune-sampling-confidence-time", "2.5",
            "--autotune_warmup_time", "3",
            "--is-output-autotune-log",
            "--default_bucket_size", "4194304",
            "--bucket-size", "1048576",
            "--no-hierarchical-reduce",
            "train.py",
        ]
    )  # fmt: skip
    assert options == AutotuneOptions(
        autotune_level=1,
        autotune_max_samples=12,
        autotune_sampling_confidence_time=2.5,
        autotune_warmup_time=3.0,
        is_output_autotune_log=True,
        default_bucket_size=4194304,
        bucket_size=1048576,
        hierarchical_reduce=False,
    )
    assert options.writes_log


@pytest.mark.parametrize("spelling", ["--hierarchical_reduce", "--hierarchical-reduce"])
def test_hierarchical_on(spelling):
    assert parse([spelling, "t.py"])[1].hierarchical_reduce is True


@pytest.mark.parametrize(
    "spelling", ["--no-hierarchical_reduce", "--no_hierarchical_reduce", "--no-hierarchical-reduce"]
)
def test_hierarchical_off(spelling):
    assert parse([spelling, "t.py"])[1].hierarchical_reduce is False


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--autotune_level", "3"], "--autotune_level/--autotune-level: must be 0, 1 or 2, got '3'"),
        (["--autotune_max_samples", "0"], "must be an integer of at least 1, got '0'"),
        (["--autotune_warmup_time", "-1"], "--autotune-warmup-time: must be a positive number of seconds"),
        (["--autotune_warmup_time", "0"], "must be a positive number of seconds, got '0'"),
        (["--autotune_sampling_confidence_time", "nan"], "must be a positive number of seconds"),
        (["--autotune_sampling_confidence_time", "inf"], "must be a positive number of seconds"),
        (["--bucket_size", "1.5"], "--bucket-size: must be a positive whole number of bytes"),
        (["--default_bucket_size", "-4"], "must be a positive whole number of bytes"),
        (["--bucket_size", str(2**60)], "--bucket-size: must be a positive whole number of bytes, at most 2**48 (256 TiB), got '1152921504606846976'"),
        (["--autotune_service_port", "70000"], "must be a port in [0, 65535]"),
        (["--autotune_service_addr", "node0:29501"], "must be a URL like http://HOST:PORT"),
        (["--autotune_service_addr", "http://node0"], "must be a URL like http://HOST:PORT"),
        (["--autotune_log_file", "/no/such/dir/x.log"], "directory '/no/such/dir' does not exist"),
        (["--autotune_best_file", "/no/such/b.json"], "directory '/no/such' does not exist"),
        # The service refused it as it started: exit 1 under its own 13-line usage text.
        (["--autotune_log_file", "/dev/null"], "--autotune-log-file: '/dev/null' is not a regular file"),
        (["--autotune_config", "/no/such/c.yml"], "--autotune_config: cannot read '/no/such/c.yml'"),
        # It said "cannot read '.': Is a directory" (Path("") is ".").
        (["--autotune-config="], "--autotune_config: must be a file path, got ''"),
        (["--autotune_service_bind", "node0:80"], "must be an address to listen on, like 0.0.0.0"),
        (["--autotune_service_bind", "a b"], "must be an address to listen on"),
        (["--autotune_service_bind", ""], "must be an address to listen on"),
        # torchrun's flags that torch would take with a traceback, or hang on
        (["--nproc_per_node", "abc"], "argument --nproc_per_node: must be a number of processes"),
        (["--nproc_per_node", "0"], "argument --nproc_per_node: must be a number of processes"),
        (["--nnodes", "0"], "argument --nnodes: must be N or MIN:MAX with 0 < MIN <= MAX"),
        (["--nnodes", "a:b"], "argument --nnodes: must be N or MIN:MAX with 0 < MIN <= MAX, got 'a:b'"),
        (["--nnodes", "3:2"], "argument --nnodes: must be N or MIN:MAX"),
        (["--nnodes", "1:2"], "argument --nnodes: 1:2 is a range, but the static rendezvous (the default --rdzv_backend) waits for all 2 nodes"),
        (["--max_restarts", "-1"], "argument --max_restarts: must be 0 or more, got -1"),
        (["--monitor_interval", "0"], "argument --monitor_interval: must be a positive number"),
        (["--nnodes", "2", "--node_rank", "2"], "argument --node_rank: must be in [0, 2)"),
        (["--node_rank", "-1"], "argument --node_rank: must be in [0, 1)"),
        (["--rdzv_conf", "garbage"], "argument --rdzv_conf: The rendezvous configuration option"),
        (["--redirects", "9"], "argument --redirects: must be 0 (none), 1 (stdout), 2 (stderr) or 3"),
        (["--tee", "x"], "argument --tee: must be 0 (none), 1 (stdout), 2 (stderr) or 3 (both), or per local rank like 0:1,1:2, got 'x'"),
        (["--log-dir", "/etc/passwd/logs"], "argument --log_dir: '/etc/passwd' is not a directory"),
        (["--rdzv-backend", "nope"], "argument --rdzv_backend: must be one of c10d, etcd, etcd-v2, static, got 'nope'"),
        (["--rdzv-endpoint", "node0:port"], "argument --rdzv_endpoint: The port number of the rendezvous endpoint 'node0:port'"),
        (["--local-ranks-filter", "0,x"], "argument --local_ranks_filter: must be local ranks separated by commas"),
        (["--logs-specs", "nope"], "argument --logs_specs: Could not find entrypoint"),
        (["--no-python", "-m"], "arguments --no-python and --module (-m) cannot be used together"),
        (["--standalone", "--nnodes", "2"], "argument --standalone: runs one node, but --nnodes 2 waits for 2"),
        # level 2's flags do nothing at another level: refused, not silently ignored
        (["--autotune_mode", "tune"], "argument --autotune_mode: only level 2 runs trials, and this job is level 0: add --autotune_level 2, or leave it out"),
        (["--autotune_level", "1", "--autotune-max-trials", "5"], "argument --autotune_max_trials: only level 2 runs trials, and this job is level 1"),
    ],
)  # fmt: skip
def test_invalid_values_exit_2_with_one_line_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse([*argv, "train.py"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("distune-run: error: ")
    assert message in err


def _unwritable_directory(tmp_path):
    """A directory this user cannot create files in: root can in any mode-0500 one."""
    if os.geteuid() != 0:
        directory = tmp_path / "read-only"
        directory.mkdir(mode=0o500)
        return directory
    if os.path.isdir("/proc/sys") and not os.access("/proc/sys", os.W_OK):
        return Path("/proc/sys")
    pytest.skip("no directory root cannot write to on this machine")


@pytest.mark.parametrize("flag", ["--autotune_log_file", "--autotune_best_file"])
def test_an_output_in_a_directory_the_user_cannot_write_exits_2(flag, tmp_path, capsys):
    # The log failed as the service started, under its usage text; the best-file only at
    # completion, after the whole tuning run, as an error on the service's stderr.
    directory = _unwritable_directory(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        parse([flag, str(directory / "out"), "train.py"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert f"directory {str(directory)!r} is not writable" in err


def test_symlinked_log_path_is_refused(tmp_path, capsys):
    target = tmp_path / "elsewhere.log"
    target.write_text("")
    (tmp_path / "link.log").symlink_to(target)
    with pytest.raises(SystemExit):
        parse(["--autotune_log_file", str(tmp_path / "link.log"), "t.py"])
    assert "is a symlink, which is refused" in capsys.readouterr().err


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_config_file_is_merged_and_flags_win(tmp_path, suffix):
    settings = {"autotune_level": 1, "autotune_max_samples": 30, "bucket_size": 2**22}
    path = tmp_path / f"c{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps(settings))
    else:
        path.write_text("autotune_level: 1\nautotune_max_samples: 30\nbucket_size: 4194304\n")
    _, options = parse(["--autotune_config", str(path), "--autotune_max_samples", "5", "t.py"])
    assert options.autotune_level == 1
    assert options.bucket_size == 2**22
    assert options.autotune_max_samples == 5


def test_best_file_is_a_config_file(tmp_path):
    best = {
        "bucket_size": 2**22,
        "hierarchical_reduce": False,
        "autotune_result": {"models": {"model0": {"score": 10.0, "gain_vs_default": 0.1}}},
    }
    path = tmp_path / "best.json"
    path.write_text(json.dumps(best))
    _, options = parse(["--autotune_config", str(path), "--autotune_level", "1", "t.py"])
    assert (options.bucket_size, options.hierarchical_reduce) == (2**22, False)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "autotune_levle: 1\nbucket_sise: 3\n",
            "unknown key(s) 'autotune_levle' (did you mean 'autotune_level'?), 'bucket_sise' (did "
            "you mean 'bucket_size'?)",
        ),
        ("".join(f"k{i}: 1\n" for i in range(9)), "'k4' and 4 more in"),
        (
            "autotuning: {enabled: true, arg_mappings: {train_micro_batch_size_per_gpu: --bs}}\n",
            "unknown key(s) 'autotuning' (is DeepSpeed's autotuner section: give arg_mappings at "
            "the top level, and its other settings as flags (--autotune_level 2",
        ),
        ("autotune_warmup_time: -2\n", "autotune_warmup_time must be a positive number of seconds"),
        (
            "bucket_size: true\n",
            "bucket_size must be a positive whole number of bytes, at most 2**48 (256 TiB), got True",
        ),
        (
            "autotune_warmup_time: yes\n",
            "autotune_warmup_time must be a positive number of seconds, got True",
        ),
        ("hierarchical_reduce: 1\n", "hierarchical_reduce must be true or false, got 1"),
        ("[1, 2]\n", "must hold a mapping of setting names to values"),
        ("a: [unclosed\n", "is not valid YAML or JSON"),
        # A key given twice: YAML and JSON parsers keep the last, silently (level 2 ran).
        (
            "autotune_level: 1\nautotune_max_samples: 5\nautotune_level: 2\n",
            "c.yaml': key 'autotune_level' is given twice (lines 1 and 3): keep one",
        ),
        ('{"bucket_size": 4096, "bucket_size": 8192}', "is given twice (both on line 1)"),
        ("zero_optimization:\n  stage: 1\n  stage: 3\n", "key 'stage' is given twice"),
    ],
)
def test_bad_config_files_exit_2_naming_the_key(tmp_path, text, message, capsys):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(SystemExit) as exit_info:
        parse(["--autotune_config", str(path), "t.py"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert message in err


def test_a_yaml_merge_key_may_be_overridden_beside_it(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("zero_optimization:\n  <<: {stage: 1}\n  stage: 0\n")
    assert load_config(path) == {"zero_optimization": {"stage": 0}}


def test_a_config_file_may_hold_level_2_settings_for_a_run_at_another_level(tmp_path):
    config = tmp_path / "shared.yaml"
    config.write_text("autotune_max_trials: 8\nautotune_metric: latency\n")
    _, options = parse(["--autotune_level", "1", "--autotune_config", str(config), "t.py"])
    assert (options.autotune_level, options.autotune_max_trials) == (1, 8)


def test_quiet_flag_and_config_key(tmp_path):
    assert parse(["--autotune-quiet", "t.py"])[1].autotune_quiet is True
    assert parse(["t.py"])[1].autotune_quiet is False
    config = tmp_path / "q.yaml"
    config.write_text("autotune_quiet: true\n")
    assert parse(["--autotune_config", str(config), "t.py"])[1].autotune_quiet is True


def test_service_bind_flag_and_config_key(tmp_path):
    assert (
        parse(["--autotune-service-bind", "0.0.0.0", "t.py"])[1].autotune_service_bind == "0.0.0.0"
    )
    assert parse(["--autotune_service_bind", "[::]", "t.py"])[1].autotune_service_bind == "::"
    config = tmp_path / "b.yaml"
    config.write_text("autotune_service_bind: 10.0.0.5\n")
    assert parse(["--autotune_config", str(config), "t.py"])[1].autotune_service_bind == "10.0.0.5"


def test_device_keywords_for_nproc_per_node_are_left_to_the_machine_that_runs_the_job():
    # A recipe for GPU nodes is planned and tested on machines without one.
    for keyword in ("gpu", "cpu", "auto", "xpu"):
        assert parse(["--nproc_per_node", keyword, "t.py"])[0].nproc_per_node == keyword


@pytest.mark.skipif(torch.cuda.is_available(), reason="'gpu' resolves on a machine with CUDA")
@pytest.mark.parametrize("level", ["0", "1", "2"])
def test_a_device_keyword_this_machine_lacks_exits_2_at_any_level(level, capsys):
    assert main(["--nproc_per_node", "gpu", "--autotune_level", level, "train.py"]) == 2
    assert capsys.readouterr().err == (
        "distune-run: error: argument --nproc_per_node: 'gpu' on this machine: "
        "Cuda is not available.\n"
    )


@pytest.mark.parametrize(
    ("launch", "message"),
    [
        (["missing.py"], "training script 'missing.py': no such file (the working directory is "),
        (["-m", "no_such_module_for_distune.sub"],
         "module 'no_such_module_for_distune.sub' (-m): no module named "
         "'no_such_module_for_distune' in the working directory"),
        (["."], "training script '.' is a directory without a __main__.py"),
        (["--no-python", "no-such-command-for-distune"],
         "--no-python command 'no-such-command-for-distune' is not on the PATH"),
        (["--no-python", "./t.py"], "--no-python command './t.py' is not an executable file"),
        (["sh", "t.py"], "training script 'sh': no such file (the working directory is "),
    ],
)  # fmt: skip
@pytest.mark.parametrize("level", ["0", "1", "2"])
def test_a_script_that_is_not_there_exits_2_before_anything_starts(
    tmp_path, monkeypatch, capsys, launch, message, level
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.py").write_text("print('a script, not an executable')\n")
    assert main(["--nproc_per_node", "2", "--autotune_level", level, *launch]) == 2
    out, err = capsys.readouterr()
    assert err.startswith(f"distune-run: error: {message}")
    assert err.count("\n") == 1
    assert "tuning service" not in out


def test_a_command_typed_before_the_script_is_named_as_one(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # `distune-run python train.py`, as one runs `python train.py`
    (tmp_path / "train.py").write_text("")
    assert main(["--nproc_per_node", "2", "sh", "train.py"]) == 2
    assert (
        capsys.readouterr()
        .err.rstrip()
        .endswith(
            "'sh' is a command: distune-run runs the script with its own Python, so leave 'sh' "
            "out, or give --no-python to run a command"
        )
    )


def test_scripts_modules_and_commands_that_are_there_pass_the_check(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__main__.py").write_text("")
    (tmp_path / "mod.py").write_text("")
    for launch in (
        ["mod.py"],
        ["pkg"],
        ["-m", "mod"],
        ["-m", "json.tool"],
        ["--no-python", "true"],
    ):
        check_training_script(parse(launch)[0])


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--autotune_log_file", "out", "--autotune_best_file", "./out"],
            "--autotune_log_file: 'out' is also --autotune_best_file, which the best-file would "
            "replace when a model completes; give --autotune_log_file a file of its own",
        ),
        (
            ["--autotune_log_file", "train.py"],
            "'train.py' is also the training script, which the log would empty as the service "
            "starts",
        ),
        (["--autotune_best_file", "hard.py"], "'hard.py' is also the training script"),
        (
            ["--autotune_config", "c.yaml", "--autotune_log_file", "c.yaml"],
            "'c.yaml' is also the config file (--autotune_config), which the log would empty",
        ),
    ],
)
def test_the_log_and_best_file_may_not_overwrite_each_other_or_the_jobs_files(
    tmp_path, monkeypatch, flags, message, capsys
):
    """Each was accepted: the log truncated the training script before any rank read it, and
    the best-file replaced the log (same path) when the model completed."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('training')\n")
    (tmp_path / "hard.py").hardlink_to("train.py")
    (tmp_path / "c.yaml").write_text("autotune_level: 1\n")
    with pytest.raises(SystemExit) as exit_info:
        parse([*flags, "train.py"])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    # The config file may take the next choice: the command then reads it on its next run.
    parse(["--autotune_config", "c.yaml", "--autotune_best_file", "c.yaml", "train.py"])
    parse(["--autotune_log_file", "train.py", "-m", "train"])  # a module: no file of that path


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--autotune_log_file", "x.log"], "--autotune_log_file: it takes"),
        (["--is_output_autotune_log", "--autotune-max-samples", "10"],
         "--autotune_max_samples, --is_output_autotune_log: they take"),
        (["--autotune_best_file", "b.json"], "--autotune_best_file: it takes"),
        (["--autotune_quiet"], "--autotune_quiet: it takes"),
        (["--autotune_service_port", "29600"], "--autotune_service_port: it takes"),
    ],
)  # fmt: skip
def test_tuning_flags_at_level_0_are_named_as_ignored(tmp_path, monkeypatch, flags, named):
    """Level 0 (the default) starts no service: a log or best-file asked for was silently never
    written, a sample budget never used, when --autotune_level 1 was forgotten."""
    monkeypatch.chdir(tmp_path)

    def unused(*argv):
        args, options = parse(["--nproc_per_node", "2", *argv, "t.py"])
        tuned = plan_launch(args, options).placement is not None
        return unused_tuning_flags(args, options, tuned)

    assert unused(*flags) == (
        f"{named} effect only where a job is tuned, and this job is level 0, the default: "
        "ignored; add --autotune_level 1 to tune"
    )
    assert unused("--autotune_level", "1", *flags) is None
    # One rank (torchrun's default) has nothing to tune: said so, not "every knob is pinned".
    one_rank = parse(["--nproc_per_node", "1", "--autotune_level", "1", *flags, "t.py"])
    assert unused_tuning_flags(*one_rank, tuned=False).endswith(
        "and this job has one rank (--nnodes 1, --nproc_per_node 1), which exchanges no "
        "gradients, so level 1 has nothing to tune and no service starts: ignored"
    )
    # At level 1 with every knob pinned (one node: the bucket size), nothing is tuned either.
    assert unused("--autotune_level", "1", "--bucket_size", "4096", *flags).endswith(
        "every knob of this job is pinned (--bucket_size, and --[no-]hierarchical_reduce where "
        "there are several nodes), so nothing is tuned and no service starts: ignored"
    )
    # Knob pins reach level 0's ranks; a config file may hold other levels' settings.
    assert unused("--bucket_size", "4096", "--default_bucket_size", "8192") is None
    assert unused("--autotune_device_memory", "1GiB") is None
    (tmp_path / "c.yaml").write_text("autotune_max_samples: 5\n")
    assert unused("--autotune_config", "c.yaml") is None
