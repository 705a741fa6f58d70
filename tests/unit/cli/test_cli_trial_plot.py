"""``distune plot`` of a level-2 run: a results directory whose trials.jsonl the launcher's own
report writer wrote (ok, out-of-memory, crashed and re-measured trials, one in bf16), and files
that are not one."""

from __future__ import annotations

import json

import matplotlib.image
import numpy as np
import pytest

from distune.cli.main import main
from distune.cli.trial_log import read_trials
from distune.cli.trial_plot import best
from distune.launcher.trial_report import TrialReport
from distune.tuning_service.trials.trial_config import TrialConfig
from distune.tuning_service.trials.trial_result import THROUGHPUT, TrialResult

MiB = 2**20


def trial(
    index, config, outcome="ok", purpose="search", throughput=None, peak=None, predicted=None
):
    return TrialResult(
        trial=index,
        config=config,
        world_size=2,
        outcome=outcome,
        purpose=purpose,
        throughput=throughput,
        throughput_spread=0.05 if throughput else None,
        step_seconds=32 / throughput if throughput else None,
        peak_memory_bytes=peak,
        predicted_memory_bytes=predicted,
        duration=20.0,
        error="Traceback ...\nValueError: x" if outcome == "crash" else None,
    )


@pytest.fixture
def results(tmp_path):
    directory = tmp_path / "results"
    directory.mkdir()
    report = TrialReport(directory, THROUGHPUT)
    for result in [
        trial(0, TrialConfig(2, 8, 0, False), purpose="profile", throughput=29.0, peak=20 * MiB),
        trial(1, TrialConfig(16, 1, 0, False), "oom", predicted=31 * MiB),
        trial(2, TrialConfig(8, 2, 0, False), throughput=64.0, peak=28 * MiB, predicted=27 * MiB),
        trial(3, TrialConfig(8, 2, 0, False, bf16=True), throughput=70.0, peak=24 * MiB,
              predicted=27 * MiB),
        trial(4, TrialConfig(8, 2, 2, False), "crash", predicted=22 * MiB),
        trial(5, TrialConfig(16, 1, 1, True), throughput=30.0, peak=20 * MiB, predicted=21 * MiB),
        trial(6, TrialConfig(8, 2, 0, False), purpose="remeasure", throughput=56.0,
              peak=28 * MiB, predicted=28 * MiB),
    ]:  # fmt: skip
        report.add(result)
    return directory


def test_the_launchers_trials_jsonl_reads_back_whole(results):
    trials = read_trials(results / "trials.jsonl")
    assert [t.outcome for t in trials] == ["ok", "oom", "ok", "ok", "crash", "ok", "ok"]
    assert trials[3].config.bf16 and trials[5].config.checkpointing
    # The best configuration by its mean: ddp 8 x 2 in bf16 (70) over ddp 8 x 2 ((64 + 56) / 2).
    chosen, mean = best(trials)
    assert chosen.trial == 3 and mean == 70.0


def test_plot_of_a_results_directory_draws_throughput_and_memory_panels(results, tmp_path, capsys):
    image = tmp_path / "trials.png"
    assert main(["plot", str(results), "-o", str(image)]) == 0
    assert capsys.readouterr().out == f"wrote {image}\n"
    pixels = matplotlib.image.imread(image)
    assert pixels.shape[:2] == (460, 1300)  # 13 x 4.6 inches at 100 dpi
    assert pixels[..., :3].std() > 0.05
    gold = np.all(np.abs(pixels[..., :3] - np.array([1.0, 0.843, 0.0])) < 0.02, axis=-1)
    assert gold.sum() > 100  # the best configuration's star
    # The trials.jsonl itself plots the same; the default image is named after it.
    assert main(["plot", str(results / "trials.jsonl"), "-o", str(tmp_path / "same.png")]) == 0
    assert (tmp_path / "same.png").stat().st_size > 20_000


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("", "holds no trial"),
        ('{"trial": 0\n', "line 1: not JSON"),
        ("[1, 2]\n", "line 1: not a trial record: a JSON object, got list"),
        ('{"trial": 0, "outcome": "ok"}\n', "line 1: not a trial record (no 'config')"),
    ],
)
def test_a_bad_trials_file_is_a_one_line_error_naming_it(content, message, tmp_path, capsys):
    path = tmp_path / "trials.jsonl"
    path.write_text(content)
    assert main(["plot", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("distune plot: ") and message in err and err.count("\n") == 1


def test_a_record_with_a_bad_outcome_and_a_directory_without_trials_are_refused(
    results, tmp_path, capsys
):
    lines = (results / "trials.jsonl").read_text().splitlines()
    record = json.loads(lines[2])
    record["outcome"] = "fine"
    (results / "trials.jsonl").write_text("\n".join([lines[0], json.dumps(record)]) + "\n")
    assert main(["plot", str(results)]) == 1
    assert "line 2: not a trial record: outcome must be one of" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["plot", str(empty)]) == 1
    assert "is a directory without trials.jsonl" in capsys.readouterr().err


def test_a_trials_file_whose_last_record_was_cut_short_plots_the_finished_trials(
    results, tmp_path, capsys
):
    text = (results / "trials.jsonl").read_text()
    cut = tmp_path / "trials.jsonl"
    cut.write_text(text + text.splitlines()[0][:30])  # a trial's record being written
    assert len(read_trials(cut)) == 7
    assert f"{cut}: its last line is cut short" in capsys.readouterr().err


def test_a_failed_profile_is_labelled_the_scripts_own_not_one_by_one() -> None:
    from distune.cli.trial_plot import label
    from distune.tuning_service.trials.trial_config import TrialConfig
    from distune.tuning_service.trials.trial_result import TrialResult

    failed = TrialResult(0, TrialConfig(1, 1, 0, False), 2, "crash", "profile")
    assert label(failed) == "own"
    assert label(TrialResult(1, TrialConfig(8, 2, 0, True), 2, "oom", "search")) == "8x2 c"
