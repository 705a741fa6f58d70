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
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests

from tests.support.launcher_process import (
    RESTARTABLE,
    LauncherProcess,
    isolated_rendezvous,
)
from tests.support.local_host import free_port

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "deterministic_worker.py"
#: The model name the worker registers.
MODEL = "faults"


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
