"""The tuning service as a child process of the launcher: started, watched and stopped by it.

The service runs as its own process (``python -m distune.tuning_service``) so that it outlives
worker restarts and never shares an interpreter with training. It announces its address with
one JSON line on stdout once its socket is bound; the launcher then waits for
``/api/v1/health``. On Linux the service also gets SIGTERM if the launcher dies without
stopping it, so no orphan keeps the port.
"""

from __future__ import annotations

import ctypes
import json
import os
import selectors
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlsplit

import requests

from distune.errors import DistuneError
from distune.service_auth import bearer_headers
from distune.worker_settings import SERVICE_TOKEN

HEALTH_PATH = "/api/v1/health"
STATUS_PATH = "/api/v1/status"
_PR_SET_PDEATHSIG = 1


class ServiceStartError(DistuneError, RuntimeError):
    """The tuning service did not come up; the message says what happened."""


def _die_with_parent() -> None:
    # Runs in the child between fork and exec: ask the kernel for SIGTERM when the launcher dies.
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass(frozen=True)
class ServiceAnnouncement:
    """The line a started service prints: where it listens, and where it logs (if it does)."""

    url: str
    log_file: str | None

    @classmethod
    def parse(cls, line: str) -> ServiceAnnouncement:
        """Parse the JSON listening line; raises ServiceStartError on anything else."""
        try:
            data = json.loads(line)
            if data.get("event") != "listening" or not isinstance(data.get("url"), str):
                raise ValueError
            if urlsplit(data["url"]).port is None:
                raise ValueError
        except (ValueError, AttributeError):
            raise ServiceStartError(f"unexpected first line from the service: {line!r}") from None
        log_file = data.get("log_file")
        return cls(url=data["url"], log_file=log_file if isinstance(log_file, str) else None)


class TuningServiceProcess:
    """A running ``python -m distune.tuning_service``; use :meth:`start`, then :meth:`stop`."""

    def __init__(
        self, process: subprocess.Popen[str], announcement: ServiceAnnouncement, token: str
    ):
        self._process = process
        self._token = token
        self.url = announcement.url
        self.log_file = announcement.log_file

    @classmethod
    def start(
        cls, service_args: list[str], token: str, timeout: float = 60.0
    ) -> TuningServiceProcess:
        """Start the service with ``service_args`` and wait until it answers health checks.

        The token travels in the environment, never on the command line where ``ps`` shows it.
        """
        env = {**os.environ, SERVICE_TOKEN: token}
        process = subprocess.Popen(
            [sys.executable, "-m", "distune.tuning_service", *service_args],
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            env=env,
            text=True,
            # Its own session: a Ctrl-C in the terminal reaches the launcher, which stops the
            # service after reading the final status, rather than killing it first.
            start_new_session=True,
            preexec_fn=_die_with_parent,  # safe: the launcher has no threads yet
        )
        try:
            deadline = time.monotonic() + timeout
            announcement = ServiceAnnouncement.parse(_read_line(process, deadline))
            service = cls(process, announcement, token)
            service._wait_healthy(deadline)
        except BaseException:
            _terminate(process)
            raise
        return service

    @property
    def alive(self) -> bool:
        """Whether the service process is still running."""
        return self._process.poll() is None

    @property
    def pid(self) -> int:
        """The service's process id."""
        return self._process.pid

    @property
    def port(self) -> int:
        """The port the service listens on."""
        port = urlsplit(self.url).port
        assert port is not None  # ServiceAnnouncement.parse checked the URL
        return port

    @property
    def returncode(self) -> int | None:
        """The exit code once the process has ended, else None."""
        return self._process.poll()

    def status(self, timeout: float = 5.0) -> dict[str, Any] | None:
        """``GET /api/v1/status``, or None if the service does not answer it."""
        response = self._get(STATUS_PATH, timeout)
        try:
            return None if response is None else response.json()
        except ValueError:
            return None

    def log(self, model: str, timeout: float = 5.0) -> str | None:
        """``GET /api/v1/models/<model>/log`` (CSV text), or None if it does not answer."""
        response = self._get(f"/api/v1/models/{quote(model, safe='')}/log", timeout)
        return None if response is None else response.text

    def _get(self, path: str, timeout: float) -> requests.Response | None:
        try:
            response = requests.get(
                self.url + path,
                headers=bearer_headers(self._token),
                timeout=timeout,
            )
            response.raise_for_status()
        except requests.RequestException:
            return None
        return response

    def stop(self, timeout: float = 10.0) -> int | None:
        """Stop the service (SIGTERM, then SIGKILL after ``timeout``); its exit code."""
        _terminate(self._process, timeout)
        return self._process.returncode

    def _wait_healthy(self, deadline: float) -> None:
        while True:
            try:
                if requests.get(self.url + HEALTH_PATH, timeout=2.0).ok:
                    return
            except requests.RequestException:
                pass
            if not self.alive:
                raise ServiceStartError(f"the service exited with code {self._process.returncode}")
            if time.monotonic() > deadline:
                raise ServiceStartError(f"the service at {self.url} did not answer health checks")
            time.sleep(0.1)


def _read_line(process: subprocess.Popen[str], deadline: float) -> str:
    assert process.stdout is not None
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if selector.select(timeout=0.1):
                line = process.stdout.readline()
                if line:
                    return line.strip()
            if process.poll() is not None:
                raise ServiceStartError(
                    f"the service exited with code {process.returncode} before listening"
                )
    raise ServiceStartError("the service did not start listening in time")


def _terminate(process: subprocess.Popen[str], timeout: float = 10.0) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    if process.stdout is not None:
        process.stdout.close()
