"""``--autotune_resume`` reuses only the trials of the same job (``job.json``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from distune.launcher.level2 import trial_world
from distune.launcher.main import main
from distune.launcher.options import OptionError, parse, trial_pins
from distune.launcher.tuned_job import JOB_FILE, OtherJobError, TunedJob

MAPPINGS = "arg_mappings: {train_micro_batch_size_per_gpu: --bs}\n"


def earlier_run(tmp_path: Path, argv: list[str]) -> Path:
    """A results directory of an earlier level-2 run of ``argv``."""
    results = tmp_path / "earlier"
    results.mkdir(exist_ok=True)
    (results / "trials.jsonl").write_text("")
    args, options = parse(["--autotune_level", "2", *argv])
    job = TunedJob.of(args, trial_pins(args), options.autotune_device_memory, trial_world(args))
    job.write(results)
    return results


def resume(results: Path, argv: list[str]) -> bool:
    args, options = parse(["--autotune_level", "2", "--autotune_resume", str(results), *argv])
    job = TunedJob.of(args, trial_pins(args), options.autotune_device_memory, trial_world(args))
    return job.check_resume(results)


def test_the_same_job_resumes_whatever_its_mapped_flags_say(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(MAPPINGS)
    flags = ["--nproc_per_node", "2", "--autotune_config", str(config)]
    results = earlier_run(tmp_path, [*flags, "train.py", "--bs", "4", "--lr", "1"])
    # The mapped flag is what trials vary; the rest is the job.
    assert resume(results, [*flags, "train.py", "--lr", "1", "--bs=16"]) is True
    assert json.loads((results / JOB_FILE).read_text())["script_args"] == ["--lr", "1"]


@pytest.mark.parametrize(
    ("now", "named"),
    [
        (["--nproc_per_node", "2", "other.py", "--lr", "1"], "script: "),
        (["--nproc_per_node", "2", "train.py", "--lr", "2"], "script_args: ['--lr', '1'] there"),
        (["--nproc_per_node", "4", "train.py", "--lr", "1"], "world_size: 2 there, 4 here"),
        (
            ["--nproc_per_node", "2", "--autotune_device_memory", "1GiB", "train.py", "--lr", "1"],
            "device_memory: None there, 1073741824 here",
        ),
        (["--nproc_per_node", "2", "-m", "train.py", "--lr", "1"], "'-m train.py' here"),
    ],
)
def test_another_jobs_trials_are_refused_naming_what_differs(tmp_path, now, named):
    results = earlier_run(tmp_path, ["--nproc_per_node", "2", "train.py", "--lr", "1"])
    with pytest.raises(OtherJobError, match="are of another job") as error:
        resume(results, now)
    assert named in str(error.value)


def test_a_resume_of_another_job_exits_2_before_anything_starts(tmp_path, capsys):
    config = tmp_path / "pinned.yaml"
    config.write_text("zero_optimization: {stage: 1}\n")
    results = earlier_run(tmp_path, ["--nproc_per_node", "2", "train.py"])
    argv = [
        "--nproc_per_node", "2", "--autotune_level", "2", "--autotune_resume", str(results),
        "--autotune_config", str(config), "train.py",
    ]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr()
    assert "distune-run: error: --autotune_resume: the trials in" in err.err
    assert "pinned: {} there, {'zero_optimization': {'stage': 1}} here" in err.err
    assert "tuning service" not in err.out


def test_a_script_changed_since_its_trials_is_not_resumed(tmp_path, capsys):
    # A crash recorded before the script was fixed used to be reused as if it still held.
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit(1)  # the bug\n")
    results = earlier_run(tmp_path, ["--nproc_per_node", "2", str(script)])
    assert resume(results, ["--nproc_per_node", "2", str(script)]) is True  # unchanged
    script.write_text("pass  # fixed\n")
    argv = ["--nproc_per_node", "2", "--autotune_level", "2", "--autotune_resume", str(results),
            str(script)]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "distune-run: error: --autotune_resume: the trials in" in err
    assert "(the script's content differs: what its trials measured, crashes included" in err
    assert "resume only the same script, unchanged" in err
    assert "start afresh with a new --autotune_results_dir" in err


def test_a_directory_scripts_content_is_its_main(tmp_path):
    package = tmp_path / "app"
    package.mkdir()
    (package / "__main__.py").write_text("pass\n")
    results = earlier_run(tmp_path, [str(package)])
    (package / "__main__.py").write_text("pass  # changed\n")
    with pytest.raises(OtherJobError, match="script's content differs"):
        resume(results, [str(package)])


def test_a_job_json_of_an_earlier_version_is_resumed_without_the_content_check(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    results = earlier_run(tmp_path, [str(script)])
    recorded = json.loads((results / JOB_FILE).read_text())
    del recorded["script_sha256"]  # as an earlier version wrote it
    (results / JOB_FILE).write_text(json.dumps(recorded))
    script.write_text("pass  # changed\n")
    assert resume(results, [str(script)]) is True
    del recorded["world_size"]  # a field every version wrote is still compared
    (results / JOB_FILE).write_text(json.dumps(recorded))
    with pytest.raises(OtherJobError, match="world_size: None there, 1 here"):
        resume(results, [str(script)])


def test_a_results_directory_from_before_job_json_cannot_be_checked(tmp_path):
    results = earlier_run(tmp_path, ["train.py"])
    (results / JOB_FILE).unlink()
    assert resume(results, ["other.py"]) is False


@pytest.mark.parametrize("text", ["[]", "null", '"job"', "3"])
def test_a_job_file_that_is_no_object_is_refused_naming_it(tmp_path, text):
    results = earlier_run(tmp_path, ["train.py"])
    (results / JOB_FILE).write_text(text)
    with pytest.raises(OtherJobError, match=r"job\.json holds no job record") as error:
        resume(results, ["train.py"])
    assert f"{text}: was it edited?" in str(error.value)


@pytest.mark.parametrize(
    ("line", "why"),
    [
        ('{"trial": 1, "config": {"train_micro_batch_size_per_gpu": 8}', "JSONDecodeError"),
        ('{"trial": 1, "outcome": "ok"}', "KeyError: 'config'"),
        ('{"trial": 1, "config": {"train_micro_batch_size_per_gpu": 2}}', "TrialConfigError"),
    ],
)
def test_a_results_directory_with_a_broken_trial_line_exits_2_naming_it(
    tmp_path, line, why, capsys
):
    results = earlier_run(tmp_path, ["train.py"])
    (results / "trials.jsonl").write_text(line + "\n")
    assert main(["--autotune_level", "2", "--autotune_resume", str(results), "train.py"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        f"distune-run: error: --autotune_resume: {results / 'trials.jsonl'} line 1 is not a "
        f"trial record ({why}"
    )


def test_a_resume_keeps_the_finished_trials_of_a_file_whose_last_line_was_cut(tmp_path, capsys):
    from distune.launcher.level2 import earlier_results
    from distune.tuning_service.trials.trial_config import TrialConfig
    from distune.tuning_service.trials.trial_result import TrialResult

    results = earlier_run(tmp_path, ["train.py"])
    record = TrialResult(0, TrialConfig(2, 4, 0, False), 1, "crash", "profile", error="boom")
    cut = '{"trial": 1, "config": {"train_micro_ba'
    (results / "trials.jsonl").write_text(json.dumps(record.to_json()) + "\n" + cut)
    assert earlier_results(results) == [record]
    # Through distune-run: the cut line is named, and the run goes on to its next check (the
    # script, missing here) instead of refusing the finished trial.
    assert main(["--autotune_level", "2", "--autotune_resume", str(results), "train.py"]) == 2
    err = capsys.readouterr().err
    assert f"distune: {results / 'trials.jsonl'}: its last line is cut short" in err
    assert "training script 'train.py'" in err
    # A damaged finished line is still refused.
    (results / "trials.jsonl").write_text(cut + "\n" + json.dumps(record.to_json()))
    with pytest.raises(OptionError, match="line 1 is not a trial record"):
        earlier_results(results)


def test_resuming_in_place_keeps_every_earlier_record(tmp_path):
    from distune.launcher.level2 import Level2
    from distune.launcher.trial_client import TrialClient
    from distune.tuning_service.trials.trial_config import TrialConfig
    from distune.tuning_service.trials.trial_result import TrialResult

    results = earlier_run(tmp_path, ["--nproc_per_node", "2", "train.py"])
    record = TrialResult(0, TrialConfig(2, 4, 0, False), 2, "crash", "profile", error="boom")
    lines = json.dumps(record.to_json()) + "\n"
    (results / "trials.jsonl").write_text(lines)
    argv = [
        "--nproc_per_node", "2", "--autotune_level", "2", "--autotune_resume", str(results),
        "--autotune_results_dir", str(results), "train.py",
    ]  # fmt: skip
    args, options = parse(argv)
    level2 = Level2(args, options, trial_pins(args), argv, TrialClient("http://127.0.0.1:9"))
    assert level2.earlier == [record]
    # The records are written again as they are reused; until then they are kept beside.
    assert not (results / "trials.jsonl").exists()
    assert (results / "trials.before-resume-1.jsonl").read_text() == lines
