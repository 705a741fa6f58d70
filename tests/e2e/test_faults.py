"""Faults during a real job: one representative run of each scenario of the fault-injection
benchmark (``benchmarks/fault_injection.py`` runs them many times, at random moments).

Each run trains ``benchmarks/faults/deterministic_worker.py`` on 2 ranks, so its final
parameters must equal, bit for bit, those of an untuned run without any fault.
"""

from __future__ import annotations

import random
import secrets
import signal
from urllib.parse import urlsplit

import pytest
from benchmarks.faults.job import FaultJob, WorkerSpec, worker_results
from benchmarks.faults.scenarios import service_kill, stuck_rendezvous_signal, worker_kill

from tests.support.launcher_process import FAST_TUNING
from tests.support.local_host import port_is_free

pytestmark = pytest.mark.slow

#: Long enough to reach sampling (warmup 1 s) and finish a sample before the faults below.
SPEC = WorkerSpec(steps=450, sleep=0.01)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> str:
    """The final parameters' digest of an untuned, fault-free run (no pause: same math)."""
    out = tmp_path_factory.mktemp("reference")
    job = FaultJob(WorkerSpec(steps=SPEC.steps, sleep=0.0).argv(out), token=None)
    assert job.wait(120) == 0, job.output
    digests = {result["sha256"] for result in worker_results(out).values()}
    assert len(digests) == 1, digests
    return digests.pop()


@pytest.mark.timeout(240)
def test_service_killed_mid_sample_the_job_ends_right_and_loses_no_sample(reference, tmp_path):
    result = service_kill("mid-sample", random.Random(1), SPEC, tmp_path, reference)
    assert result.problems == [], result
    assert result.observed == "sampling"
    assert (result.exit_code, result.death_notices, result.lost_rows) == (0, 1, 0)
    assert result.kept_group_right and result.wrong_params is False


@pytest.mark.timeout(240)
def test_a_killed_worker_restarts_and_tuning_resumes_without_measuring_again(reference, tmp_path):
    result = worker_kill(random.Random(2), SPEC, tmp_path, reference, exhaust=False)
    assert result.problems == [], result
    assert result.exit_code == 0 and result.wrong_params is False
    assert result.repeated == [] and result.lost_rows == 0


@pytest.mark.timeout(180)
def test_sighup_to_the_launcher_stops_workers_and_service(tmp_path):
    job = FaultJob(
        ["--autotune_level", "1", *FAST_TUNING, *SPEC.argv(tmp_path)],
        token=secrets.token_urlsafe(16),
    )
    found = job.service()
    assert found is not None, job.output
    url, _ = found
    assert job.wait_for_status(url, lambda status: True, timeout=90), job.output  # registered
    try:
        job.process.send_signal(signal.SIGHUP)
        assert job.wait(120) == 128 + signal.SIGHUP, job.output
        assert "distune-run: stopping on SIGHUP" in job.output
        assert job.leftovers() == []
        assert port_is_free(urlsplit(url).port)
    finally:
        job.kill_all()


@pytest.mark.timeout(120)
def test_sigint_stops_a_launcher_stuck_in_the_rendezvous_and_its_service(tmp_path):
    # Node 0 of a two-node job whose other node never comes: torch waits in C++.
    result = stuck_rendezvous_signal(signal.SIGINT, random.Random(3), tmp_path)
    assert result.problems == [], result
    assert result.observed == "rendezvous"
    assert result.exit_code == 128 + signal.SIGINT and result.leftovers == 0
    # Not a timing claim: without the watchdog, torch's rendezvous would hold it for minutes.
    assert result.stop_seconds < 60
