"""The CSV tuning log and the best-file: format, one row per sample, safe creation."""

import csv
import json
import os
import stat

import pytest

from distune.space import FixedKnobs, ModelFacts
from distune.tuning_service.best_file import BestFileError, best_document, write_best_file
from distune.tuning_service.config import TuningConfig
from distune.tuning_service.messages import Registration, Report
from distune.tuning_service.service import TuningService
from distune.tuning_service.tuning_log import COLUMNS, LogFileError, TuningLog

FACTS = ModelFacts(world_size=8, nnodes=2, local_world_size=4, gradient_bytes=2**26)
CONFIG = TuningConfig(
    max_samples=5, sampling_confidence_time=2.0, min_windows=2, warmup_time=0.0, seed=3
)


def tune(service: TuningService, name: str = "m", fixed: FixedKnobs | None = None) -> None:
    """Drive ``name`` to completion with a landscape that favours 2^20 buckets."""
    reply = service.register(name, Registration(FACTS, fixed or FixedKnobs()))
    for step in range(1, 1000):
        bucket = reply.group.hyperparameters.bucket_size_2p
        rate = 100.0 / (1.0 + 0.05 * abs(bucket - 20))
        reply = service.report(name, Report(reply.group.id, step, 100, 100 / rate))
        if reply.completed:
            return
    raise AssertionError("tuning did not complete")


def read_rows(path):
    with open(path, newline="") as file:
        return list(csv.reader(file))


def test_header_starts_with_bagua_columns_and_each_sample_is_one_row(tmp_path):
    log = TuningLog.create(directory=str(tmp_path))
    service = TuningService(CONFIG, log=log)
    reply = service.register("m", Registration(FACTS))
    header = read_rows(log.path)[0]
    assert header[:4] == ["bucket_size_2p", "is_hierarchical_reduce", "score", "train_iter"]
    assert tuple(header) == COLUMNS
    # Rows appear as samples finish, readable while the service still runs.
    for step in range(3):
        reply = service.report("m", Report(reply.group.id, step, 10, 1.0))
    rows = read_rows(log.path)[1:]
    assert len(rows) == 1
    assert rows[0][:4] == ["25", "False", "10.0", "2"]
    assert rows[0][COLUMNS.index("phase")] == "default"
    tune(service)
    rows = read_rows(log.path)[1:]
    phases = [row[COLUMNS.index("phase")] for row in rows]
    assert phases[-1] == "completed" and "completed" not in phases[:-1]
    assert [int(row[COLUMNS.index("sample")]) for row in rows[:-1]] == list(range(1, len(rows)))
    assert len(rows) - 1 == service.status()["models"]["m"]["samples"]
    assert service.log_csv("m") == log.path.read_text()


def test_default_log_name_is_unpredictable_private_and_new(tmp_path):
    names = set()
    for _ in range(3):
        log = TuningLog.create(directory=str(tmp_path))
        assert log.path.parent == tmp_path
        assert log.path.name.startswith("distune_autotune_") and log.path.suffix == ".log"
        assert stat.S_IMODE(os.stat(log.path).st_mode) == 0o600
        names.add(log.path.name)
        log.close()
    assert len(names) == 3


def test_explicit_log_path_is_created_private_and_a_symlink_is_refused(tmp_path):
    log = TuningLog.create(path=tmp_path / "tuning.csv")
    assert stat.S_IMODE(os.stat(log.path).st_mode) == 0o600
    log.close()
    target = tmp_path / "victim"
    target.write_text("precious\n")
    link = tmp_path / "link.csv"
    link.symlink_to(target)
    with pytest.raises(LogFileError, match="symbolic link"):
        TuningLog.create(path=link)
    assert target.read_text() == "precious\n"
    with pytest.raises(LogFileError, match="directory"):
        TuningLog.create(path=tmp_path)
    with pytest.raises(LogFileError, match="regular file"):
        TuningLog.create(path=os.devnull)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(LogFileError):  # and no hang waiting for a reader
        TuningLog.create(path=fifo)
    with pytest.raises(LogFileError):
        TuningLog.create(path=tmp_path / "missing" / "log.csv")


def test_best_file_for_one_model_carries_the_launcher_keys(tmp_path):
    best = tmp_path / "best.json"
    service = TuningService(CONFIG, best_path=best)
    tune(service)
    document = json.loads(best.read_text())
    view = service.views()[0]
    hp = view.best.group.hyperparameters
    assert document["bucket_size"] == hp.bucket_size
    assert document["hierarchical_reduce"] is hp.is_hierarchical_reduce
    entry = document["autotune_result"]["models"]["m"]
    assert entry == {
        "group": view.best.group.to_dict(),
        "score": view.best.score,
        "default_score": view.default_score,
        "gain_vs_default": view.best.gain_vs_default,
        "gain_margin": view.best.gain_margin,
        "verdict": view.verdict,
        "samples": view.samples,
    }
    assert stat.S_IMODE(os.stat(best).st_mode) == 0o600


def test_best_file_for_several_models_has_no_job_wide_keys(tmp_path):
    best = tmp_path / "best.json"
    service = TuningService(CONFIG, best_path=best)
    tune(service, "a")
    service.register("b", Registration(FACTS, FixedKnobs(bucket_size_2p=18)))
    assert "bucket_size" not in best_document(service.views())
    tune(service, "b", FixedKnobs(bucket_size_2p=18))
    document = json.loads(best.read_text())
    assert set(document) == {"autotune_result"}
    assert set(document["autotune_result"]["models"]) == {"a", "b"}


def test_best_file_refuses_a_symlink(tmp_path):
    target = tmp_path / "victim"
    target.write_text("precious\n")
    link = tmp_path / "best.json"
    link.symlink_to(target)
    with pytest.raises(BestFileError, match="symbolic link"):
        write_best_file(link, [])
    assert target.read_text() == "precious\n"
