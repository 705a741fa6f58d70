"""The fault scenarios: each starts one job, injects one fault, and checks what survived it.

A scenario returns a :class:`RunResult` whose ``problems`` list every deviation from what
distune promises (empty: the run is clean). "Wrong final parameters" compares each rank's
SHA-256 of its final parameters with a fault-free run's, bit for bit: with two ranks the result
does not depend on the groups the job ran with (see ``deterministic_worker.py``), and
:func:`reference_digest` checks that on every invocation by comparing a tuned run with an
untuned one.
"""

from __future__ import annotations

import contextlib
import os
import random
import secrets
import shutil
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from benchmarks.faults import checks
from benchmarks.faults.job import FaultJob, WorkerSpec, worker_pid, worker_results
from tests.support.launcher_process import FAST_TUNING, RESTARTABLE
from tests.support.local_host import free_port, is_running, port_is_free

#: A job still running this long after its fault is a hang.
HANG_SECONDS = 240.0
#: Service-kill moments.
MOMENTS = ("warmup", "mid-sample", "switch", "completed")


@dataclass
class RunResult:
    """One faulted run; ``problems`` is empty when everything held."""

    scenario: str
    moment: str
    observed: str = ""
    exit_code: int | None = None
    hang: bool = False
    wrong_params: bool | None = None
    lost_rows: int = 0
    repeated: list[str] = field(default_factory=list)
    death_notices: int | None = None
    kept_group_right: bool | None = None
    leftovers: int = 0
    stop_seconds: float | None = None
    seconds: float = 0.0
    #: Workers that aborted at exit in C++ ("terminate called ..."): not a tuner fault, counted.
    aborts: int = 0
    problems: list[str] = field(default_factory=list)
    #: The job's last output lines, kept when something went wrong.
    output_tail: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready copy."""
        return dict(self.__dict__)


def _fresh(workdir: Path) -> tuple[Path, Path]:
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    return workdir / "out", workdir / "tune.csv"


def _tuned_job(
    out: Path, log: Path, spec: WorkerSpec, *flags: str, rendezvous: str = "static"
) -> FaultJob:
    argv = ["--autotune_level", "1", *FAST_TUNING, "--autotune_log_file", str(log), *flags]
    return FaultJob(
        [*argv, *spec.argv(out)], token=secrets.token_urlsafe(24), rendezvous=rendezvous
    )


def _with_output(result: RunResult, job: FaultJob) -> RunResult:
    if result.problems:
        result.output_tail = job.output.splitlines()[-60:]
    return result


def _finish(job: FaultJob, result: RunResult, service_url: str | None) -> None:
    """Wait for the job; record hang, exit code, leftovers and the service's port."""
    code = job.wait(HANG_SECONDS)
    if code is None:
        result.hang = True
        result.problems.append(f"still running {HANG_SECONDS:.0f} s after the fault")
        job.kill_all()
    result.exit_code = code
    result.aborts = job.output.count("terminate called")
    result.leftovers = len(job.leftovers())
    if result.leftovers:
        result.problems.append(f"{result.leftovers} processes left behind")
    if service_url is not None:
        port = urlsplit(service_url).port
        if port is not None and not port_is_free(port):
            result.problems.append(f"service port {port} still bound")
    result.seconds = time.monotonic() - job.started


def _check_params(result: RunResult, out: Path, reference: str, attempt: int | None) -> None:
    results = worker_results(out)
    digests = {rank: r["sha256"] for rank, r in results.items()}
    result.wrong_params = sorted(digests) != [0, 1] or set(digests.values()) != {reference}
    if result.wrong_params:
        result.problems.append(f"final parameters {digests} differ from the reference")
    if attempt is not None and any(r["attempt"] != attempt for r in results.values()):
        result.problems.append(f"results from attempts {[r['attempt'] for r in results.values()]}")


def _check_log(
    result: RunResult, log: Path, served_before: str | None, samples_before: int
) -> None:
    if not log.exists():
        result.problems.append("no CSV log")
        return
    rows = checks.parse_rows(log.read_text())
    torn = checks.torn_lines(log)
    lost = checks.lost_rows(served_before, log)
    # /status may have counted a sample whose /log row we did not fetch: count it too.
    lost = max(lost, samples_before - len(checks.sample_rows(rows)))
    result.lost_rows = lost + torn
    if result.lost_rows:
        result.problems.append(f"{lost} finished samples missing from the CSV, {torn} torn rows")
    result.repeated = checks.repeated_samples(rows)
    if result.repeated:
        result.problems.append(f"samples measured twice: {result.repeated}")


def reference_digest(spec: WorkerSpec, workdir: Path) -> str:
    """The final parameters' digest of a fault-free tuned run; it must equal an untuned run's
    (the claim that the group schedule cannot change the result) and be the same on both ranks.
    """
    digests = []
    for level in ("1", "0"):
        out, log = _fresh(workdir / f"reference-level{level}")
        argv = ["--autotune_level", level, *FAST_TUNING]
        if level == "1":
            argv += ["--autotune_log_file", str(log)]
        job = FaultJob([*argv, *spec.argv(out)], token=secrets.token_urlsafe(24))
        code = job.wait(HANG_SECONDS)
        if code != 0:
            job.kill_all()
            raise RuntimeError(f"the reference run (level {level}) failed:\n{job.output}")
        found = {r["sha256"] for r in worker_results(out).values()}
        if len(found) != 1:
            raise RuntimeError(f"the ranks of the reference run disagree: {found}")
        digests.append(found.pop())
    if digests[0] != digests[1]:
        raise RuntimeError(
            "a tuned run and an untuned run end with different parameters: bit equality "
            "cannot be the criterion for this worker"
        )
    return digests[0]


def _state(status: dict[str, Any] | None) -> str:
    return "not registered" if status is None else str(status["state"])


def _started_service(job: FaultJob, result: RunResult) -> tuple[str, int] | None:
    """The service's URL and pid; None when it never started (recorded, the job finished)."""
    found = job.service()
    if found is None:
        result.problems.append("the service never started")
        _finish(job, result, None)
    return found


def _before_fault(
    job: FaultJob, url: str, shown: dict[str, Any] | None, result: RunResult
) -> tuple[dict[str, Any] | None, str | None]:
    """The model's status and served log just before the fault; records the state seen
    (``shown``: the status that showed the awaited moment, None if it never came)."""
    before, served = job.status(url), job.log(url)
    result.observed = _state(before) if shown is not None else f"missed ({_state(before)})"
    return before, served


def _wait_for_moment(
    job: FaultJob, url: str, moment: str, rng: random.Random
) -> dict[str, Any] | None:
    """Wait for ``moment`` (plus a random delay within it); the status that showed it."""
    if moment == "warmup":
        status = job.wait_for_status(url, lambda s: True, 120)
        time.sleep(rng.uniform(0.0, 0.8))
    elif moment == "mid-sample":
        status = job.wait_for_status(url, lambda s: s["state"] == "sampling", 120)
        time.sleep(rng.uniform(0.0, 1.5))
    elif moment == "switch":
        # Kill as soon as /status shows a new group: the job applies it at its next sync point.
        status = job.wait_for_status(url, lambda s: s["state"] == "sampling", 120)
        for _ in range(rng.randint(1, 2)):
            if status is None:
                break
            current = status["current"]["id"]
            status = job.wait_for_status(url, lambda s, c=current: s["current"]["id"] != c, 60)
    else:
        status = job.wait_for_status(url, lambda s: s["state"] == "completed", 120)
        time.sleep(rng.uniform(0.0, 2.0))
    return status


def service_kill(
    moment: str, rng: random.Random, spec: WorkerSpec, workdir: Path, reference: str
) -> RunResult:
    """SIGKILL the service at ``moment``; the job must finish with the right parameters, every
    finished sample in the CSV, and one notice naming the group it kept."""
    result = RunResult("service-kill", moment)
    out, log = _fresh(workdir)
    job = _tuned_job(out, log, spec)
    found = _started_service(job, result)
    if found is None:
        return _with_output(result, job)
    url, pid = found
    shown = _wait_for_moment(job, url, moment, rng)
    before, served = _before_fault(job, url, shown, result)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        result.problems.append("the service was gone before the kill")
    _finish(job, result, url)
    if result.exit_code != 0:
        result.problems.append(f"exit code {result.exit_code}")
    _check_params(result, out, reference, attempt=0)
    _check_log(result, log, served, 0 if before is None else int(before["samples"]))
    notices = checks.death_notices(job.output)
    result.death_notices = len(notices)
    if len(notices) != 1:
        result.problems.append(f"{len(notices)} dead-service notices")
    named, ranks = checks.kept_groups(job.output), worker_results(out)
    if 0 in ranks:
        kept = ranks[0]["groups"][-1][1]
        # Named once, or twice when the service died after completing the model but before the
        # leader learned of it: then rank 0 (what it keeps) and the launcher (what the service
        # chose) both speak, and both must be right.
        result.kept_group_right = bool(named) and set(named) == {kept}
        if not result.kept_group_right:
            result.problems.append(f"the output says the job keeps {named}, it kept {kept!r}")
    return _with_output(result, job)


def worker_kill(
    rng: random.Random,
    spec: WorkerSpec,
    workdir: Path,
    reference: str,
    exhaust: bool,
    rendezvous: str = RESTARTABLE,
) -> RunResult:
    """SIGKILL a worker mid-sampling under ``--max_restarts 1``. Without ``exhaust``, the job
    must restart, resume tuning where it was (no sample measured twice) and end right; with it,
    a worker of the restarted job is killed too, and the launcher must exit non-zero and stop
    the service. ``rendezvous``: see :class:`FaultJob` (torch's default fails restarts)."""
    moment = "sampling" if rendezvous == RESTARTABLE else f"sampling, {rendezvous} rendezvous"
    result = RunResult("worker-kill" + ("-no-restart-left" if exhaust else ""), moment)
    out, log = _fresh(workdir)
    job = _tuned_job(out, log, spec, "--max_restarts", "1", rendezvous=rendezvous)
    found = _started_service(job, result)
    if found is None:
        return _with_output(result, job)
    url, service_pid = found
    shown = job.wait_for_status(url, lambda s: s["state"] == "sampling" and s["samples"] >= 1, 120)
    time.sleep(rng.uniform(0.0, 1.0))
    before, served = _before_fault(job, url, shown, result)
    for attempt in (0, 1) if exhaust else (0,):
        pid = worker_pid(out, rng.randint(0, 1), attempt, timeout=120)
        if attempt == 1:
            time.sleep(rng.uniform(0.5, 2.0))
        if pid is None:
            result.problems.append(f"no worker of attempt {attempt} to kill")
            continue
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    _finish(job, result, url)
    if exhaust:
        if result.exit_code in (0, None):
            result.problems.append(f"exit code {result.exit_code}, expected a failure")
        if is_running(service_pid):
            result.problems.append("the service still runs")
        return _with_output(result, job)
    if result.exit_code != 0:
        result.problems.append(f"exit code {result.exit_code}")
    if job.output.count("tuning service at") != 1:
        result.problems.append("the service was started more than once")
    _check_params(result, out, reference, attempt=1)
    samples_before = 0 if before is None else int(before["samples"])
    _check_log(result, log, served, samples_before)
    if log.exists():
        rows = checks.parse_rows(log.read_text())
        after, completed = len(checks.sample_rows(rows)), len(rows) > len(checks.sample_rows(rows))
        result.observed += f", {samples_before} samples before the kill, {after} in the end"
        if result.observed.startswith("sampling") and after <= samples_before and not completed:
            result.problems.append("tuning did not resume after the restart")
    return _with_output(result, job)


def launcher_signal(
    sig: signal.Signals, rng: random.Random, spec: WorkerSpec, workdir: Path
) -> RunResult:
    """Send ``sig`` to the launcher at a random moment of a tuned job: it must exit with
    128 + the signal's number and leave no process and no bound port behind."""
    result = RunResult("launcher-signal", sig.name)
    out, log = _fresh(workdir)
    job = _tuned_job(out, log, spec)
    time.sleep(rng.uniform(1.0, 15.0))
    found = job.service(timeout=0)
    url = None if found is None else found[0]
    result.observed = "starting" if url is None else _state(job.status(url))
    if job.process.poll() is not None:
        result.problems.append("the job ended before the signal")
    sent = time.monotonic()
    job.process.send_signal(sig)
    _finish(job, result, url)
    result.stop_seconds = time.monotonic() - sent
    # Before its handlers are installed (imports), the default action applies: still a stop.
    accepted = {128 + sig} if url is not None else {128 + sig, -sig, 1}
    if result.exit_code not in accepted:
        result.problems.append(f"exit code {result.exit_code}, expected {128 + sig}")
    return _with_output(result, job)


def stuck_rendezvous_signal(sig: signal.Signals, rng: random.Random, workdir: Path) -> RunResult:
    """Node 0 of a two-node job whose other node never comes waits in torch's rendezvous (C++);
    ``sig`` must still stop it, its service and its port, within the watchdog's grace."""
    result = RunResult("stuck-rendezvous-signal", sig.name)
    out, _ = _fresh(workdir)
    job = FaultJob(
        [
            "--nnodes",
            "2",
            "--node_rank",
            "0",
            "--master_addr",
            "127.0.0.1",
            "--autotune_level",
            "1",
            "--autotune_service_port",
            str(free_port()),
            *WorkerSpec().argv(out),
        ],
        token=secrets.token_urlsafe(24),
        nproc=1,
    )
    found = job.service()
    url = None if found is None else found[0]
    time.sleep(rng.uniform(0.5, 3.0))
    result.observed = "rendezvous" if url is not None else "starting"
    sent = time.monotonic()
    job.process.send_signal(sig)
    _finish(job, result, url)
    result.stop_seconds = time.monotonic() - sent
    if result.exit_code != 128 + sig:
        result.problems.append(f"exit code {result.exit_code}, expected {128 + sig}")
    return _with_output(result, job)
