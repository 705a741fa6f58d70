"""``distune log`` and ``distune plot`` on a log the real service wrote for a scripted two-model
run (and on copies of it: moved, with Windows line ends, cut short, damaged)."""

import math
import random
import shutil

import matplotlib.image
import numpy as np
import pytest

from distune.cli.log_reader import read_log
from distune.cli.main import main
from distune.tuning_service.config import TuningConfig
from distune.tuning_service.messages import Registration, Report
from distune.tuning_service.service import TuningService
from distune.tuning_service.tuning_log import COLUMNS, TuningLog
from distune.wording import describe_hyperparameters
from tests.support.models import SINGLE_NODE_REGISTRATION as FACTS
from tests.support.service_reports import report

#: Iterations per second of each model's synthetic job, by bucket_size_2p: best at 2^20.
MODELS = {
    "gpt": lambda p: 60.0 + 40.0 * math.exp(-(((p - 20) / 2.5) ** 2)),
    "mlp": lambda p: 30.0 + 20.0 * math.exp(-(((p - 20) / 2.5) ** 2)),
}


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """(the log's path, the service's final status) of a completed two-model run."""
    path = tmp_path_factory.mktemp("log") / "autotune.log"
    log = TuningLog.create(path)
    config = TuningConfig(
        max_samples=6, sampling_confidence_time=1.0, min_windows=2, warmup_time=1.0, seed=0
    )
    service = TuningService(config, log)
    for name, rate in MODELS.items():
        reply, train_iter = service.register(name, Registration.from_json(FACTS)), 0
        while not reply.completed:
            iterations = round(rate(reply.group.hyperparameters.bucket_size_2p) * 0.5)
            train_iter += iterations
            reply = report(service, name, reply, train_iter, iterations)
    log.close()
    return path, service.status()["models"]


def test_the_reader_knows_the_columns_the_service_writes():
    from distune.cli.log_reader import NUMERIC_COLUMNS, REQUIRED_COLUMNS, TEXT_COLUMNS

    assert set(NUMERIC_COLUMNS) | set(TEXT_COLUMNS) == set(REQUIRED_COLUMNS)
    assert [c for c in COLUMNS if c in REQUIRED_COLUMNS] == list(REQUIRED_COLUMNS)
    assert COLUMNS[:4] == ("bucket_size_2p", "is_hierarchical_reduce", "score", "train_iter")


def test_read_log_splits_models_and_finds_each_choice(recorded):
    path, status = recorded
    runs = read_log(path)
    assert [run.name for run in runs] == list(MODELS)
    for run in runs:
        model = status[run.name]
        assert len(run.samples) == model["samples"]
        assert list(run.samples["sample"]) == list(range(1, model["samples"] + 1))
        assert run.samples["phase"].iloc[0] == "default"
        assert run.default_score == pytest.approx(model["default_score"])
        hp = model["best"]["group"]["hyperparameters"]
        assert run.choice["bucket_size_2p"] == hp["bucket_size_2p"]
        assert run.choice["score"] == pytest.approx(model["best"]["score"])
        assert run.running_best.is_monotonic_increasing
        assert run.running_best.iloc[-1] == run.samples["score"].max()


def test_a_model_registered_again_reads_as_one_run_per_registration(tmp_path, capsys):
    # Wrapped again after unfreezing: the service tunes it afresh in the same log. Read as one
    # run, the two shapes' samples were merged, sample numbers interleaved.
    path = tmp_path / "autotune.log"
    log = TuningLog.create(path)
    config = TuningConfig(
        max_samples=3, sampling_confidence_time=1.0, min_windows=2, warmup_time=0.0, seed=0
    )
    service = TuningService(config, log)
    for gradient_bytes in (2**20, 2**24):
        facts = Registration.from_json({**FACTS, "gradient_bytes": gradient_bytes})
        reply, train_iter = service.register("m", facts), 0
        while not reply.completed:
            iterations = round(MODELS["gpt"](reply.group.hyperparameters.bucket_size_2p) * 0.5)
            train_iter += iterations
            reply = report(service, "m", reply, train_iter, iterations)
    log.close()
    status = service.status()["models"]["m"]
    runs = read_log(path)
    assert [run.name for run in runs] == [
        "m (registration 1 of 2)",
        "m (registration 2 of 2)",
    ]
    for run, session in zip(runs, [*status["earlier"], status], strict=True):
        assert list(run.samples["sample"]) == list(range(1, session["samples"] + 1))
        assert run.choice["score"] == pytest.approx(session["best"]["score"])
    assert runs[1].samples["bucket_size_2p"].iloc[0] == 24, "the new shape's default"
    assert main(["log", str(path)]) == 0
    assert f"tuning log {path}: 1 model, 2 registrations\n" in capsys.readouterr().out


def test_distune_log_summarizes_each_model(recorded, capsys):
    path, status = recorded
    assert main(["log", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"tuning log {path}: 2 models"
    assert lines[1].split()[:4] == ["model", "state", "samples", "best"]
    for line, (name, model) in zip(lines[2:], sorted(status.items()), strict=True):
        best = model["best"]
        bucket = best["group"]["hyperparameters"]["bucket_size_2p"]
        assert line.split()[:3] == [name, "completed", str(model["samples"])]
        assert f"bucket 2^{bucket} B" in line
        assert f"{best['score']:.4g} it/s" in line
        assert f"{best['gain_vs_default']:+.1%}" in line
        assert f"{model['default_score']:.4g} it/s" in line
        # Time spent: the seconds the samples measured, the job's own clock.
        measured = sum(
            float(row.split(",")[8])
            for row in path.read_text().splitlines()[1:]
            if f",{name}," in row and ",completed," not in row
        )
        assert f"{measured:.1f} s" in line


def test_distune_log_samples_lists_every_sample_with_the_running_best(recorded, capsys):
    path, status = recorded
    assert main(["log", str(path), "--samples"]) == 0
    out = capsys.readouterr().out
    section = out.split("\ngpt: gains vs the default group's")[1].split("\n\n")[0]
    section = section.splitlines()[1:]
    assert section[0].split()[:4] == ["sample", "phase", "group", "score"]
    assert len(section) == 1 + status["gpt"]["samples"]
    assert section[1].split()[:2] == ["1", "default"]
    best = [float(line.split(" it/s")[1].split()[-1]) for line in section[1:]]
    assert best == sorted(best)


def test_a_log_copied_elsewhere_with_windows_line_ends_plots_the_same(
    recorded, tmp_path, monkeypatch, capsys
):
    path, _ = recorded
    copy = tmp_path / "copied" / "from-node0.log"
    copy.parent.mkdir()
    copy.write_bytes(path.read_bytes().replace(b"\n", b"\r\n"))
    assert [r.samples.to_dict() for r in read_log(copy)] == [
        r.samples.to_dict() for r in read_log(path)
    ]
    monkeypatch.chdir(tmp_path)
    assert main(["plot", str(copy)]) == 0
    assert capsys.readouterr().out == "wrote from-node0.png\n"
    assert (tmp_path / "from-node0.png").stat().st_size > 0


def test_distune_plot_draws_a_png_of_sane_size_with_a_panel_per_model(recorded, tmp_path, capsys):
    path, _ = recorded
    image = tmp_path / "run.png"
    assert main(["plot", str(path), "-o", str(image)]) == 0
    assert capsys.readouterr().out == f"wrote {image}\n"
    assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert 20_000 < image.stat().st_size < 1_000_000
    pixels = matplotlib.image.imread(image)
    # 10 x 3.6 inches per model at 100 dpi: two models stack two panels.
    assert pixels.shape[:2] == (720, 1000)
    # Drawn, not blank: many colours, and the chosen group's gold star among them.
    assert pixels[..., :3].std() > 0.05
    gold = np.all(np.abs(pixels[..., :3] - np.array([1.0, 0.843, 0.0])) < 0.02, axis=-1)
    assert gold.sum() > 100


def test_a_run_still_tuning_shows_its_best_sample_so_far(recorded, tmp_path, capsys):
    path, _ = recorded
    rows = path.read_text().splitlines()
    partial = tmp_path / "partial.log"
    # The job was killed after gpt's fourth sample: no completed row, no mlp yet.
    partial.write_text("\n".join(rows[:5]) + "\n")
    assert main(["log", str(partial)]) == 0
    summary = capsys.readouterr().out.splitlines()[2]
    assert summary.split()[:4] == ["gpt", "not", "completed", "4"]
    assert summary.split()[-1] == "-"  # chosen at no iteration
    (run,) = read_log(partial)
    assert run.choice is None and run.best["score"] == run.samples["score"].max()
    assert main(["plot", str(partial), "-o", str(tmp_path / "partial.png")]) == 0
    assert (tmp_path / "partial.png").stat().st_size > 10_000


def test_an_unfinished_runs_best_says_it_is_a_sample_not_the_tuners_pick(tmp_path, capsys):
    """On a noisy flat landscape the log's best (the highest single sample, 2^18 at 66 it/s)
    and distune status' BEST (the tuner's pick: pooled, confirmed groups first, 2^24) named
    different groups, both as "best": the log's is now marked and the mark explained."""
    path = tmp_path / "autotune.log"
    log = TuningLog.create(path)
    config = TuningConfig(
        max_samples=8, sampling_confidence_time=1.0, min_windows=2, warmup_time=1.0, seed=0
    )
    service = TuningService(config, log)
    reply, train_iter, rng = (
        service.register("m", Registration.from_json(FACTS)),
        0,
        random.Random(1),
    )
    for _ in range(22):  # the job stops before tuning completes
        iterations = round(60.0 * math.exp(rng.gauss(0.0, 0.08)) * 0.5)
        train_iter += iterations
        reply = report(service, "m", reply, train_iter, iterations)
    log.close()
    best = service.status()["models"]["m"]["best"]["group"]["hyperparameters"]
    (run,) = read_log(path)
    assert run.choice is None
    assert best["bucket_size_2p"] != run.best["bucket_size_2p"], "the scripted run's premise"
    assert main(["log", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    top = describe_hyperparameters(run.best["bucket_size_2p"], run.best["is_hierarchical_reduce"])
    assert f"{top} *" in lines[2]
    assert lines[3] == (
        "* not completed: the highest single sample so far; the tuner's own pick (distune "
        "status' BEST) pools each group's samples and prefers groups measured twice, so it can "
        "be another group until tuning completes"
    )


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no tuning log at"),
        ("", "is empty, not a tuning log"),
        (  # Bagua's four columns read as a Bagua log; with a fifth, it is neither
            "bucket_size_2p,is_hierarchical_reduce,score,train_iter,model\n22,False,1.0,5,m\n",
            "it lacks the columns sample, phase, seconds, gain_vs_default",
        ),
        (
            "bucket_size_2p,is_hierarchical_reduce,score,train_iter\n",
            "holds no sample yet",
        ),
        (",".join(COLUMNS) + "\n", "holds no sample yet"),
    ],
)
def test_files_that_are_not_tuning_logs_are_one_line_errors(content, message, tmp_path, capsys):
    path = tmp_path / "x.log"
    if content is not None:
        path.write_text(content)
    for command in ("log", "plot"):
        assert main([command, str(path)]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"distune {command}: ") and message in err and err.count("\n") == 1


def test_a_damaged_row_is_named_by_its_line(recorded, tmp_path, capsys):
    path, _ = recorded
    rows = path.read_text().splitlines()
    rows[3] = rows[3].replace(rows[3].split(",")[2], "fast", 1)
    damaged = tmp_path / "damaged.log"
    damaged.write_text("\n".join(rows) + "\n")
    assert main(["log", str(damaged)]) == 1
    assert f"{damaged} line 4: bad score value 'fast'" in capsys.readouterr().err


def test_plot_refuses_to_overwrite_its_log(recorded, tmp_path, monkeypatch, capsys):
    path, _ = recorded
    monkeypatch.chdir(tmp_path)
    log = tmp_path / "run.png"
    shutil.copy(path, log)
    assert main(["plot", str(log)]) == 1
    assert "would overwrite the log itself" in capsys.readouterr().err


BAGUA_LOG = """bucket_size_2p,is_hierarchical_reduce,score,train_iter
23,False,100.0,120
20,True,80.5,260
25,False,131.25,400
25,False,129.0,540
"""


def test_a_bagua_autotune_log_reads_as_one_model_named_after_the_file(tmp_path):
    path = tmp_path / "bagua_autotune.log"
    path.write_text(BAGUA_LOG)
    (run,) = read_log(path)
    assert run.name == "bagua_autotune" and run.source == "bagua" and run.choice is None
    assert list(run.samples["phase"]) == ["default", "bagua", "bagua", "bagua"]
    assert list(run.samples["is_hierarchical_reduce"]) == [False, True, False, False]
    assert run.default_score == 100.0
    assert run.best["score"] == 131.25 and run.best["bucket_size_2p"] == 25
    assert run.samples["gain_vs_default"].iloc[2] == pytest.approx(0.3125)
    assert run.measured_seconds is None


def test_distune_log_and_plot_show_a_bagua_log(tmp_path, capsys):
    path = tmp_path / "bagua.log"
    path.write_text(BAGUA_LOG.replace("False", "0").replace("True", "1"))  # 0/1 spelling
    assert main(["log", str(path), "--samples"]) == 0
    out = capsys.readouterr().out
    assert "Bagua log (no choice recorded)" in out
    assert "+31.2%" in out and "2^25" in out
    image = tmp_path / "bagua.png"
    assert main(["plot", str(path), "-o", str(image)]) == 0
    assert matplotlib.image.imread(image).shape[0] > 100


def test_a_bagua_log_with_a_bad_flag_names_the_line(tmp_path, capsys):
    path = tmp_path / "bagua.log"
    path.write_text(BAGUA_LOG.replace("20,True", "20,maybe"))
    assert main(["log", str(path)]) != 0
    assert "line 3: bad is_hierarchical_reduce value 'maybe'" in capsys.readouterr().err


def test_a_close_calls_legs_count_once_in_the_summary(tmp_path, capsys):
    """A close call's sample of the budget is logged as legs, one row each with the sample's
    number: the summary counts samples of the budget, as the service's status does."""
    path = tmp_path / "autotune.log"
    log = TuningLog.create(path)
    config = TuningConfig(
        max_samples=6, sampling_confidence_time=1.0, min_windows=2, warmup_time=0.0, seed=0
    )
    service = TuningService(config, log)
    reply, train_iter, count = service.register("m", Registration.from_json(FACTS)), 0, 0
    while not reply.completed:
        level = 102.0 if reply.group.hyperparameters.bucket_size_2p == 20 else 100.0
        iterations = round(level * (1.0, 1.04, 0.96)[count % 3] * 0.5)
        train_iter, count = train_iter + iterations, count + 1
        reply = report(service, "m", reply, train_iter, iterations)
    log.close()
    samples = service.status()["models"]["m"]["samples"]
    (run,) = read_log(path)
    assert len(run.samples) > samples  # legs: more rows than samples of the budget
    assert main(["log", str(path)]) == 0
    line = capsys.readouterr().out.splitlines()[2]
    assert line.split()[:3] == ["m", "completed", str(samples)]


def test_a_log_whose_last_row_was_cut_short_keeps_every_finished_row(recorded, tmp_path, capsys):
    path, _ = recorded
    text = path.read_text()
    cut = tmp_path / "cut.log"
    cut.write_text(text + text.splitlines()[1][:7])  # the job stopped while writing a row
    assert [r.samples.shape for r in read_log(cut)] == [r.samples.shape for r in read_log(path)]
    assert main(["log", str(cut)]) == 0
    out, err = capsys.readouterr()
    assert "tuning log" in out and f"{cut}: its last line is cut short" in err
    # A finished (newline-ended) last line that is damaged is still an error naming it.
    lines = text.splitlines()
    damaged = tmp_path / "damaged.log"
    last = lines[-1].replace(lines[-1].split(",")[2], "x", 1)
    damaged.write_text("\n".join([*lines[:-1], last]) + "\n")
    assert main(["log", str(damaged)]) == 1
    assert f"line {len(lines)}: bad score value 'x'" in capsys.readouterr().err


def test_plot_to_a_directory_is_refused_and_a_name_without_suffix_gets_png(
    recorded, tmp_path, capsys
):
    path, _ = recorded
    assert main(["plot", str(path), "-o", str(tmp_path)]) == 1
    assert f"-o {tmp_path} is a directory" in capsys.readouterr().err
    assert main(["plot", str(path), "-o", str(tmp_path / "tuning")]) == 0
    assert capsys.readouterr().out == f"wrote {tmp_path / 'tuning.png'}\n"
    assert (tmp_path / "tuning.png").is_file()


def test_a_choice_logged_after_the_next_registration_began_stays_with_its_own(tmp_path):
    # The head's last sample ended and its choice was still being made (the decisions worker
    # was busy) when the model was wrapped again; the unfrozen model's first sample ended
    # before the head's choice was logged, so its completed row follows the new session's
    # start in the file. Split by position, that choice was read as the new session's.
    from tests.unit.tuning_service.test_tuning_decisions import StepExecutor

    path = tmp_path / "autotune.log"
    log, worker = TuningLog.create(path), StepExecutor()
    config = TuningConfig(
        max_samples=2, sampling_confidence_time=1.0, min_windows=2, warmup_time=0.0, seed=0
    )
    service = TuningService(config, log, decisions=worker)

    def sample(step: int) -> int:
        group_id = service.views()[0].current.id
        for train_iter in range(step, step + 3):  # a discarded window, then a sample's two
            service.report("m", Report(group_id, train_iter, 100, 1.0))
        return step + 3

    service.register("m", Registration.from_json({**FACTS, "gradient_bytes": 2**20}))
    step = sample(0)
    worker.run_all()  # the head's second group
    step = sample(step)  # the head's budget is spent: its choice is pending
    service.register("m", Registration.from_json({**FACTS, "gradient_bytes": 2**24}))
    sample(step)
    worker.run_all()  # the head's choice, then the unfrozen model's next group
    log.close()
    status = service.status()["models"]["m"]
    assert status["earlier"][0]["state"] == "completed" and status["state"] == "sampling"
    rows = path.read_text().splitlines()
    assert rows[-1].split(",")[7] == "completed", "the head's choice is the file's last row"
    head, unfrozen = read_log(path)
    assert (
        head.choice is not None
        and head.choice["bucket_size_2p"]
        == (status["earlier"][0]["best"]["group"]["hyperparameters"]["bucket_size_2p"])
    )
    assert unfrozen.choice is None and list(unfrozen.samples["sample"]) == [1]


def _slow_first_default(path, stop_after=None):
    """A run whose default group's first sample reads 40 it/s (slowed by warmup) and 60 it/s
    when measured again; 2^19 to 2^21 run at 66. ``stop_after``: reports before the job ends."""
    log = TuningLog.create(path)
    config = TuningConfig(
        max_samples=8, sampling_confidence_time=1.0, min_windows=2, warmup_time=1.0, seed=0
    )
    service = TuningService(config, log)
    reply, train_iter, reports = service.register("m", Registration.from_json(FACTS)), 0, 0
    default = reply.group.hyperparameters
    while not reply.completed and reports != stop_after:
        hp = reply.group.hyperparameters
        rate = 60.0 + 6.0 * math.exp(-(((hp.bucket_size_2p - 20) / 2.5) ** 2))
        iterations = round((40.0 if hp == default and train_iter < 200 else rate) * 0.5)
        train_iter, reports = train_iter + iterations, reports + 1
        reply = report(service, "m", reply, train_iter, iterations)
    log.close()
    return service.status()["models"]["m"]


def test_log_gains_and_default_score_are_the_ones_status_judges_by(tmp_path, capsys):
    """The default's first sample (40 it/s) was the log's default score and every row's gain
    came from the log as written, each over the default's score when the row was logged: the
    summary read `66 it/s, +10.0%, default score 40 it/s` and sample 2 `+65.0%`, where the
    service judged the default at 60 it/s. Every gain now divides by that one score."""
    path = tmp_path / "autotune.log"
    status = _slow_first_default(path)
    assert status["default_score"] == pytest.approx(60.0), "the scripted run's premise"
    (run,) = read_log(path)
    assert run.default_score == pytest.approx(status["default_score"])
    assert main(["log", str(path), "--samples"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "66 it/s +10.0%" in lines[2] and "60 it/s" in lines[2]
    assert lines[4] == "m: gains vs the default group's 60 it/s (its samples after the first)"
    gains = {line.split()[0]: line.split()[10] for line in lines[6:]}
    assert gains["1"] == "-33.3%" and gains["2"] == "+10.0%"
    assert gains["8"] == "+0.0%"  # the default measured again, not a rounding's -0.0%


def test_log_gains_say_when_the_default_had_its_first_sample_only(tmp_path, capsys):
    path = tmp_path / "autotune.log"
    status = _slow_first_default(path, stop_after=8)
    (run,) = read_log(path)
    assert run.default_score == pytest.approx(status["default_score"]) == pytest.approx(40.0)
    assert main(["log", str(path), "--samples"]) == 0
    assert (
        "m: gains vs the default group's 40 it/s (its first sample, the job's first after "
        "warmup: it was not measured again)"
    ) in capsys.readouterr().out


@pytest.mark.parametrize("command", ["log", "plot"])
def test_an_empty_log_argument_is_named_not_read_as_the_current_directory(command, capsys):
    """`distune log "$LOG"` with LOG unset said ". is a directory, not a tuning log"."""
    with pytest.raises(SystemExit) as exit_info:
        main([command, ""])
    assert exit_info.value.code == 2
    assert f"distune {command}: error: argument LOG: must be a path, got ''" in (
        capsys.readouterr().err
    )


def test_a_session_reopened_by_a_drift_is_not_shown_as_completed(tmp_path, capsys):
    """After a drift reopened a completed session, distune status said `sampling` while
    distune log still said `completed`: the samples after the choice are a new round."""
    path = tmp_path / "autotune.log"
    log = TuningLog.create(path)
    config = TuningConfig(
        max_samples=4, sampling_confidence_time=1.0, min_windows=2, warmup_time=0.0, seed=0,
        retune_drift=0.2, retune_drift_time=2.0, retune_samples=3,
    )  # fmt: skip
    service = TuningService(config, log)
    reply, train_iter, drifted = service.register("m", Registration.from_json(FACTS)), 0, False
    while not (drifted and service.status()["models"]["m"]["samples"] >= 6):
        drifted = drifted or reply.completed
        rate = 66.0 if reply.group.hyperparameters.bucket_size_2p == 19 else 60.0
        iterations = round(rate * (0.5 if drifted else 1.0) * 0.5)  # another phase: slower
        train_iter += iterations
        reply = report(service, "m", reply, train_iter, iterations)
    log.close()
    status = service.status()["models"]["m"]
    assert status["retunes"] == 1 and status["state"] == "sampling"
    (run,) = read_log(path)
    assert run.choice is not None and run.reopened
    assert main(["log", str(path)]) == 0
    assert capsys.readouterr().out.splitlines()[2].split()[:4] == [
        "m",
        "reopened,",
        "re-tuning",
        "6",
    ]
