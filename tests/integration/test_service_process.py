"""The tuning service as a real process: started on a free port, driven over HTTP."""

import csv
import json
import math
import os
import random
import signal
import time

import pytest
import requests

from tests.support.service_process import TOKEN

pytestmark = pytest.mark.slow

PEAK = {"bucket_size_2p": 24, "is_hierarchical_reduce": False}


def true_throughput(hp):
    """Iterations per second, peaking at bucket 2^24 flat; hierarchical 6% slower, shifted."""
    x = hp["bucket_size_2p"] - (1 if hp["is_hierarchical_reduce"] else 0)
    shape = 50.0 + 150.0 * math.exp(-(((x - 24) / 3.5) ** 2))
    return shape * (0.94 if hp["is_hierarchical_reduce"] else 1.0)


def synthetic_client(service, name, seed, noise=0.03):
    """A leader rank: registers, reports ~1 s windows of whatever group it runs, follows the
    replies (and 409s) until the group is final. Returns the final group.

    Bounded by wall-clock time, not by a count of reports: the service chooses the next group
    in its own thread, and until it publishes it the client goes on reporting the group it
    has, as a job would; on a loaded machine that took over 2,000 reports."""
    rng = random.Random(seed)
    facts = {"world_size": 8, "nnodes": 2, "local_world_size": 4, "gradient_bytes": 2**28}
    reply = service.post(f"/api/v1/models/{name}/register", facts).json()
    group, train_iter = reply["group"], 0
    deadline = time.monotonic() + 180.0
    while time.monotonic() < deadline:
        if reply["completed"]:
            return group
        rate = true_throughput(group["hyperparameters"]) * math.exp(rng.gauss(0.0, noise))
        iterations = max(1, round(rate))
        train_iter += iterations
        window = {
            "group_id": group["id"],
            "train_iter": train_iter,
            "iterations": iterations,
            "seconds": iterations / rate,
        }
        response = service.post(f"/api/v1/models/{name}/report", window)
        assert response.status_code in (200, 409), response.text
        reply = response.json()
        group = reply["group"]
    raise AssertionError("tuning did not complete")


@pytest.mark.timeout(120)
def test_listens_on_a_free_port_answers_health_and_stops_cleanly(start_service, tmp_path):
    service = start_service("--log-dir", str(tmp_path))
    announcement = service.announcement
    assert announcement["event"] == "listening"
    assert announcement["host"] == "127.0.0.1" and 0 < announcement["port"] < 65536
    assert announcement["url"] == f"http://127.0.0.1:{announcement['port']}"
    log_file = announcement["log_file"]
    assert os.path.dirname(log_file) == str(tmp_path)
    health = requests.get(service.url + "/api/v1/health", timeout=10)
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert requests.get(service.url + "/api/v1/status", timeout=10).status_code == 401
    assert service.get("/api/v1/status").json() == {"models": {}}
    assert service.stop(signal.SIGINT) == 0
    stdout, stderr = service.output
    assert stdout == ""  # the one listening line, nothing else
    assert TOKEN not in stderr


@pytest.mark.timeout(240)
def test_a_full_tuning_run_over_http_finds_the_peak(start_service, tmp_path):
    best_file = tmp_path / "best.json"
    log_file = tmp_path / "tuning.csv"
    service = start_service(
        "--log-file", str(log_file),
        "--best-file", str(best_file),
        "--warmup-time", "2",
        "--sampling-confidence-time", "4",
        "--max-samples", "20",
        "--seed", "0",
    )  # fmt: skip
    assert service.announcement["log_file"] == str(log_file)
    final = synthetic_client(service, "model0", seed=1)
    peak = true_throughput(PEAK)
    assert true_throughput(final["hyperparameters"]) >= 0.98 * peak

    status = service.get("/api/v1/status").json()["models"]["model0"]
    assert status["state"] == "completed"
    assert status["best"]["group"] == status["current"] == final
    assert status["best"]["gain_vs_default"] > 0.0
    assert status["default_score"] == pytest.approx(true_throughput(
        {"bucket_size_2p": 25, "is_hierarchical_reduce": False}), rel=0.05)  # fmt: skip

    best = json.loads(best_file.read_text())
    assert best["bucket_size"] == 2 ** final["hyperparameters"]["bucket_size_2p"]
    assert best["autotune_result"]["models"]["model0"]["samples"] == status["samples"]

    rows = list(csv.DictReader(log_file.open()))
    assert rows[0]["phase"] == "default"
    # A close call's legs are rows that share their budget sample's number.
    assert rows[-1]["phase"] == "completed"
    assert len({row["sample"] for row in rows[:-1]}) == status["samples"]
    assert service.get("/api/v1/models/model0/log").text == log_file.read_text()
    assert service.stop() == 0


@pytest.mark.timeout(60)
def test_the_launcher_says_in_one_line_why_its_service_did_not_start(capfd):
    # A log in a directory the user cannot write (sysfs refuses new files, root included): the
    # service's argparse usage text came above the launcher's line, which gave only the code.
    from distune.launcher.service_process import ServiceStartError, TuningServiceProcess

    with pytest.raises(ServiceStartError) as error:
        TuningServiceProcess.start(["--port", "0", "--log-file", "/sys/distune.log"], TOKEN)
    assert str(error.value).startswith("cannot write the tuning log to /sys/distune.log: ")
    assert capfd.readouterr().err == ""


@pytest.mark.timeout(60)
def test_the_launchers_service_passes_its_diagnostics_on(capfd, tmp_path, monkeypatch):
    from distune.launcher.service_process import TuningServiceProcess

    # A cluster's http_proxy (no no_proxy) took the health checks to the proxy: the launch
    # failed after a minute, "did not answer health checks". The service is reached directly.
    for name in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    service = TuningServiceProcess.start(
        ["--port", "0", "--log-dir", str(tmp_path), "--log-level", "info"], TOKEN
    )
    assert service.status() == {"models": {}}
    assert service.stop() == 0
    # Logged once the service listens: it reaches the launcher's stderr through the pipe.
    assert f"tuning log: {service.log_file}" in capfd.readouterr().err
