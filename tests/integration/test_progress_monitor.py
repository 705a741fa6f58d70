"""The launcher's progress lines and dead-service notice, against a real service process."""

from __future__ import annotations

import io
import re
import signal

import pytest
import requests

from distune.launcher.progress import ProgressMonitor
from distune.launcher.service_process import TuningServiceProcess
from distune.wording import describe_group
from tests.support.service_process import TOKEN

pytestmark = pytest.mark.slow

AUTH = {"Authorization": f"Bearer {TOKEN}"}
FACTS = {"world_size": 2, "nnodes": 1, "local_world_size": 2, "gradient_bytes": 2**20}


def rate_of(group: dict) -> float:
    """A synthetic job: fastest at 2^18 bytes."""
    return 100.0 - 5.0 * abs(group["hyperparameters"]["bucket_size_2p"] - 18)


@pytest.fixture
def service():
    args = ["--host", "127.0.0.1", "--port", "0", "--seed", "0", "--max-samples", "3"]
    args += ["--warmup-time", "1", "--sampling-confidence-time", "1"]
    started = TuningServiceProcess.start(args, TOKEN)
    yield started
    started.stop()


def drive(
    service: TuningServiceProcess, monitors: list[ProgressMonitor], windows: int, facts=FACTS
) -> dict:
    """Report ``windows`` windows of 0.5 s as a job would, polling the monitors after each."""
    url = service.url + "/api/v1/models/m"
    reply = requests.post(url + "/register", json=facts, headers=AUTH, timeout=5).json()
    train_iter = 0
    for _ in range(windows):
        group = reply["group"]
        iterations = int(rate_of(group) / 2)
        train_iter += iterations
        body = {
            "group_id": group["id"],
            "train_iter": train_iter,
            "iterations": iterations,
            "seconds": 0.5,
        }
        reply = requests.post(url + "/report", json=body, headers=AUTH, timeout=5).json()
        for monitor in monitors:
            monitor.poll()
        if reply["completed"]:
            break
    return reply


def test_one_line_per_event_then_the_choice(service):
    out, quiet_out = io.StringIO(), io.StringIO()
    monitor = ProgressMonitor(service, out=out)
    quiet = ProgressMonitor(service, quiet=True, out=quiet_out)
    reply = drive(service, [monitor, quiet], windows=200)
    assert reply["completed"]
    monitor.poll()  # nothing new: no line is repeated
    lines = out.getvalue().splitlines()
    assert lines[0] == "autotune m: warmup over, sampling up to 3 groups"
    samples = [line for line in lines if " sample " in line]
    assert samples[0].startswith("autotune m sample 1/3: bucket 2^20 B (1 MiB), flat -> ")
    assert samples[0].endswith("it/s (the default group)")
    # The default has one sample yet, the job's first after warmup: the line says so, and
    # gives the interval the log carries, as the summary does for the choice.
    assert re.search(r"it/s \([+-]\d+\.\d% ± \d+\.\d% vs the default's first sample\)$", samples[1])
    assert 2 <= len(samples) <= 3
    assert [line.split(":")[0].split()[-1] for line in samples] == [
        f"{n}/3" for n in range(1, len(samples) + 1)
    ]
    assert lines[-1].startswith("autotune m: completed, chose bucket 2^")
    assert len(lines) == len(samples) + 2
    assert quiet_out.getvalue() == ""


def test_a_model_registered_again_with_other_facts_is_followed_afresh(service):
    # Wrapped again after unfreezing: before, the new session's samples were not printed
    # until they outnumbered the first session's (the log holds both sessions' rows).
    out = io.StringIO()
    monitor = ProgressMonitor(service, out=out)
    assert drive(service, [monitor], windows=200)["completed"]
    first = out.getvalue().splitlines()
    unfrozen = {**FACTS, "gradient_bytes": 2**22}
    assert not drive(service, [monitor], windows=8, facts=unfrozen)["completed"]
    status = requests.get(service.url + "/api/v1/status", headers=AUTH, timeout=5).json()
    assert status["models"]["m"]["samples"] >= 1
    assert " sample 1/3: bucket 2^22 B" in out.getvalue(), "the new sample is printed at once"
    # Registered again with the same facts: resumed, no new line.
    assert drive(service, [monitor], windows=200, facts=unfrozen)["completed"]
    lines = out.getvalue().splitlines()[len(first) :]
    assert lines[0] == (
        "autotune m: registered again with other facts (2 ranks (1 node x 2), 4194304 "
        "gradient bytes), tuning it afresh"
    )
    assert lines[1] == "autotune m: warmup over, sampling up to 3 groups"
    samples = [line for line in lines if " sample " in line]
    assert samples[0].startswith("autotune m sample 1/3: bucket 2^22 B (4 MiB), flat -> ")
    assert lines[-1].startswith("autotune m: completed, chose bucket 2^")
    assert len(lines) == len(samples) + 3


def test_a_dead_service_is_reported_once_even_when_quiet(service):
    out = io.StringIO()
    monitor = ProgressMonitor(service, quiet=True, out=out)
    drive(service, [monitor], windows=3)
    service._process.send_signal(signal.SIGKILL)
    service._process.wait(10)
    monitor.poll()
    monitor.poll()
    text = out.getvalue()
    assert text.count("the tuning service stopped unexpectedly (exit code -9)") == 1
    assert "each model keeps the last group the service gave it (rank 0 names it)" in text
    assert monitor.service_gone
    assert monitor.last_status["models"]["m"]["state"] in ("warmup", "sampling")


def test_a_dead_service_after_completion_names_the_final_group(service):
    out = io.StringIO()
    monitor = ProgressMonitor(service, quiet=True, out=out)
    reply = drive(service, [monitor], windows=200)
    assert reply["completed"]
    service._process.send_signal(signal.SIGKILL)
    service._process.wait(10)
    monitor.poll()
    chosen = describe_group(monitor.last_status["models"]["m"]["best"]["group"])
    assert out.getvalue().strip().endswith(f"training goes on: m keeps {chosen}")
    assert "rank 0 names it" not in out.getvalue()


def test_a_completion_the_monitor_missed_is_read_from_the_log_file(tmp_path):
    args = ["--host", "127.0.0.1", "--port", "0", "--seed", "0", "--max-samples", "3"]
    args += ["--warmup-time", "1", "--sampling-confidence-time", "1"]
    logged = TuningServiceProcess.start([*args, "--log-file", str(tmp_path / "t.csv")], TOKEN)
    try:
        out = io.StringIO()
        monitor = ProgressMonitor(logged, quiet=True, out=out)
        monitor.poll()  # before the model registers: the monitor never sees it complete
        reply = drive(logged, [], windows=200)
        assert reply["completed"]
        logged._process.send_signal(signal.SIGKILL)
        logged._process.wait(10)
        monitor.poll()
    finally:
        logged.stop()
    chosen = describe_group(reply["group"])
    assert out.getvalue().strip().endswith(f"training goes on: m keeps {chosen}")
