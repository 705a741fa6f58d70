"""One ``distune-run`` of the deterministic worker, watched from outside as a user's tools would.

:class:`FaultJob` (a :class:`LauncherProcess`) starts the launcher as a subprocess with a known
token (so it can read the service's ``/status`` and ``/log`` while the job runs), collects its
output line by line, finds the service's and the workers' pids, and afterwards says what the
job left behind. Every process of the job carries a marker in its environment, so leftovers are
found whatever their parents.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests

from benchmarks.local_host import free_port, is_running
from distune.launcher.plan import UNSHARED_STORE

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "deterministic_worker.py"
MARKER = "DISTUNE_FAULTS_MARKER"
#: The model name the worker registers.
MODEL = "faults"
#: Tuning short enough that a job of ~15 s samples, switches and completes.
FAST_TUNING = (
    "--autotune_warmup_time", "1",
    "--autotune_sampling_confidence_time", "1",
    "--autotune_max_samples", "4",
)  # fmt: skip


@dataclass(frozen=True)
class WorkerSpec:
    """How long the deterministic worker trains: ``steps`` steps with a ``sleep`` pause each."""

    steps: int = 800
    sleep: float = 0.01

    def argv(self, out: Path, extra: tuple[str, ...] = ()) -> list[str]:
        """The worker's part of the launcher's command line."""
        return [
            str(WORKER), "--steps", str(self.steps), "--sleep", str(self.sleep),
            "--out", str(out), *extra,
        ]  # fmt: skip


def processes_with(marker: str) -> list[int]:
    """Live (not zombie) processes whose environment carries ``marker``."""
    needle = f"{MARKER}={marker}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if needle in environ.split(b"\0") and is_running(int(entry.name)):
            found.append(int(entry.name))
    return found


#: A rendezvous after which torch 2.13 restarts gloo workers reliably: c10d, with the workers'
#: process group on a store of its own. torchrun's default (static, one store for every attempt)
#: and c10d sharing the agent's store both hand a restarted worker its predecessor's stale
#: address at random (pytorch/pytorch#135712): the restart fails or hangs in gloo's connect.
RESTARTABLE = "isolated"


def isolated_rendezvous() -> tuple[list[str], dict[str, str]]:
    """The launcher flags and environment of the :data:`RESTARTABLE` rendezvous."""
    flags = ["--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{free_port()}"]
    return flags, {UNSHARED_STORE: "1"}


class LauncherProcess:
    """``python -m distune.run ARGV`` as a subprocess whose combined output is collected line by
    line, and every process it starts marked so that it can be found (and killed) afterwards.

    The environment is this process's, without a service token (a job's token is the caller's
    choice), with ``env`` added last. The fault benchmark and the launcher's end-to-end tests
    both watch jobs through this class.
    """

    def __init__(self, argv: list[str], env: dict[str, str] | None = None) -> None:
        self.marker = uuid.uuid4().hex
        environment = {
            name: value
            for name, value in os.environ.items()
            if name not in ("DISTUNE_SERVICE_TOKEN", "DISTUNE_SERVICE_TOKEN_FILE")
        }
        environment.update({MARKER: self.marker, "DISTUNE_SYNC_INTERVAL": "0.25"})
        environment.update(env or {})
        self.started = time.monotonic()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "distune.run", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            env=environment,
            cwd=REPO,
        )
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    @property
    def output(self) -> str:
        """Everything the launcher (and its workers and service) printed so far."""
        with self._changed:
            return "\n".join(self.lines)

    def wait_for_line(self, pattern: str, timeout: float) -> re.Match[str] | None:
        """The first output line matching ``pattern``, or None after ``timeout`` or at exit."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for line in self.lines:
                    if match := regex.search(line):
                        return match
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._reader.is_alive():
                    return None
                self._changed.wait(min(remaining, 0.2))

    def wait(self, timeout: float) -> int | None:
        """The exit code, or None if the job is still running after ``timeout`` (a hang)."""
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        self._reader.join(10)
        return code

    def leftovers(self, grace: float = 10.0) -> list[int]:
        """Processes of this job still alive after ``grace`` seconds."""
        deadline = time.monotonic() + grace
        while (alive := processes_with(self.marker)) and time.monotonic() < deadline:
            time.sleep(0.1)
        return alive

    def kill_all(self) -> None:
        """SIGKILL the launcher and everything it started (after a hang; a no-op after a clean
        exit)."""
        launcher = [self.process.pid] if self.process.poll() is None else []  # not a reused pid
        for pid in [*launcher, *processes_with(self.marker)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(10)


class FaultJob(LauncherProcess):
    """A running ``distune-run``; ``argv`` are its flags, script and script arguments.

    ``token`` becomes the launcher's ``DISTUNE_SERVICE_TOKEN`` (None: the launcher's
    environment has none, unless ``env`` adds it); ``env`` is added to the environment last.
    ``rendezvous`` is torchrun's default (static, on a free ``--master_port``) or
    :data:`RESTARTABLE` (for jobs whose workers restart).
    """

    def __init__(
        self,
        argv: list[str],
        token: str | None,
        env: dict[str, str] | None = None,
        nproc: int = 2,
        rendezvous: str = "static",
    ) -> None:
        self.token = token
        environment = {} if token is None else {"DISTUNE_SERVICE_TOKEN": token}
        if rendezvous == RESTARTABLE:
            where, extra = isolated_rendezvous()
            environment.update(extra)
        else:
            where = ["--master_port", str(free_port())]
        environment.update(env or {})
        super().__init__(["--nproc_per_node", str(nproc), *where, *argv], environment)
        self._session = requests.Session()
        if token is not None:
            self._session.headers["Authorization"] = f"Bearer {token}"

    def service(self, timeout: float = 120.0) -> tuple[str, int] | None:
        """The service's URL and pid, from the launcher's line announcing it."""
        found = self.wait_for_line(r"tuning service at (http://\S+) \(pid (\d+)\)", timeout)
        return None if found is None else (found.group(1), int(found.group(2)))

    def get(self, url: str, path: str) -> requests.Response | None:
        """GET ``path`` from the service with the job's token; None when it does not answer."""
        try:
            response = self._session.get(url + path, timeout=2.0)
        except requests.RequestException:
            return None
        return response if response.ok else None

    def status(self, url: str) -> dict[str, Any] | None:
        """The model's entry in ``/api/v1/status``, or None (not registered, no answer)."""
        response = self.get(url, "/api/v1/status")
        return None if response is None else response.json().get("models", {}).get(MODEL)

    def log(self, url: str) -> str | None:
        """The model's CSV log as the service serves it (its records in memory)."""
        response = self.get(url, f"/api/v1/models/{MODEL}/log")
        return None if response is None else response.text

    def wait_for_status(self, url: str, condition: Any, timeout: float) -> dict[str, Any] | None:
        """Poll ``/status`` (every 20 ms) until ``condition(model_status)``; None if never."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.process.poll() is None:
            status = self.status(url)
            if status is not None and condition(status):
                return status
            time.sleep(0.02)
        return None

    def wait(self, timeout: float) -> int | None:
        """The exit code, or None if the job is still running after ``timeout`` (a hang)."""
        code = super().wait(timeout)
        if code is not None:
            self._session.close()
        return code


def worker_pid(out: Path, rank: int, attempt: int, timeout: float) -> int | None:
    """The pid a worker wrote at start (``pid.rank<R>.attempt<A>``), waiting for the file."""
    path = out / f"pid.rank{rank}.attempt{attempt}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError):
            return int(path.read_text())
        time.sleep(0.05)
    return None


def worker_results(out: Path) -> dict[int, dict[str, Any]]:
    """Each rank's final result (its last attempt's), by rank."""
    results: dict[int, dict[str, Any]] = {}
    for path in sorted(out.glob("rank*.attempt*.json")):
        result = json.loads(path.read_text())
        if result["attempt"] >= results.get(result["rank"], {}).get("attempt", -1):
            results[result["rank"]] = result
    return results
