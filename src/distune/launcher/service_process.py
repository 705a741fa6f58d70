"""The tuning service as a child process of the launcher: started, watched and stopped by it.

The service runs as its own process (``python -m distune.tuning_service``) so that it outlives
worker restarts and never shares an interpreter with training. It announces its address with
one JSON line on stdout once its socket is bound; the launcher then waits for
``/api/v1/health``. On Linux the service also gets SIGTERM if the launcher dies without
stopping it, so no orphan keeps the port.

Its stderr comes through a pipe: a service that fails before listening (a log path it cannot
write, a port taken) says why in one line of its own, which becomes the launcher's one-line
error rather than following the service's usage text; once it listens, a thread copies its
diagnostics (warnings) to the launcher's stderr as they come.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import IO, Any
from urllib.parse import quote, urlsplit

import requests

from distune.errors import DistuneError
from distune.service_auth import bearer_headers, direct_session
from distune.worker_settings import SERVICE_TOKEN

HEALTH_PATH = "/api/v1/health"
STATUS_PATH = "/api/v1/status"
_PR_SET_PDEATHSIG = 1
#: How the service starts the one line that says why it could not start: argparse's error
#: line (a bad setting, a log or best-file it cannot write) and its own (a port it cannot bind).
_OWN_ERROR_PREFIXES = ("python -m distune.tuning_service: error: ", "distune.tuning_service: ")


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
        self,
        process: subprocess.Popen[str],
        announcement: ServiceAnnouncement,
        token: str,
        said: list[str],
    ):
        self._process = process
        self._token = token
        self._http = direct_session()
        self.url = announcement.url
        self.log_file = announcement.log_file
        assert process.stderr is not None
        self._diagnostics = threading.Thread(
            target=_copy_lines,
            args=(said, process.stderr, sys.stderr),
            name="distune-service-stderr",
            daemon=True,
        )
        self._diagnostics.start()

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
            stderr=subprocess.PIPE,
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
            said: list[str] = []  # its stderr until it listens
            announcement = ServiceAnnouncement.parse(_read_line(process, deadline, said))
        except BaseException:
            _terminate(process)
            assert process.stderr is not None
            process.stderr.close()
            raise
        service = cls(process, announcement, token, said)
        try:
            service._wait_healthy(deadline)
        except BaseException:
            service.stop()
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
            response = self._http.get(
                self.url + path,
                headers=bearer_headers(self._token),
                timeout=timeout,
            )
            response.raise_for_status()
        except requests.RequestException:
            return None
        return response

    def stop(self, timeout: float = 10.0) -> int | None:
        """Stop the service (SIGTERM, then SIGKILL after ``timeout``); its exit code. Its last
        diagnostics are on the launcher's stderr when this returns."""
        _terminate(self._process, timeout)
        self._diagnostics.join(timeout)
        self._http.close()
        return self._process.returncode

    def _wait_healthy(self, deadline: float) -> None:
        while True:
            try:
                if self._http.get(self.url + HEALTH_PATH, timeout=2.0).ok:
                    return
            except requests.RequestException:
                pass
            if not self.alive:
                raise ServiceStartError(f"the service exited with code {self._process.returncode}")
            if time.monotonic() > deadline:
                raise ServiceStartError(f"the service at {self.url} did not answer health checks")
            time.sleep(0.1)


def _read_line(process: subprocess.Popen[str], deadline: float, said: list[str]) -> str:
    """The service's first line on stdout; what it says on stderr meanwhile goes to ``said``."""
    assert process.stdout is not None and process.stderr is not None
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        selector.register(process.stderr, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            for key, _ in selector.select(timeout=0.1):
                line = key.fileobj.readline()  # type: ignore[union-attr]
                if not line:
                    selector.unregister(key.fileobj)
                elif key.fileobj is process.stdout:
                    return str(line).strip()
                else:
                    said.append(str(line))
            if process.poll() is not None:
                said.append(process.stderr.read())  # the rest, up to its exit
                raise ServiceStartError(_why_it_exited(process.returncode, "".join(said)))
    raise ServiceStartError("the service did not start listening in time")


def _why_it_exited(returncode: int, stderr: str) -> str:
    """The reason a service that exited before listening gives: its own one-line error, without
    the usage text argparse puts above it. Anything else it wrote (a traceback) is passed on
    to the launcher's stderr as it is, and the reason is its exit code."""
    lines = stderr.rstrip().splitlines()
    last = lines[-1] if lines else ""
    for prefix in _OWN_ERROR_PREFIXES:
        if last.startswith(prefix):
            return last[len(prefix) :]
    if stderr:
        sys.stderr.write(stderr if stderr.endswith("\n") else stderr + "\n")
        sys.stderr.flush()
    return f"the service exited with code {returncode} before listening"


def _copy_lines(said: list[str], stream: IO[str], sink: IO[str]) -> None:
    """Write ``said`` and then each line of ``stream`` to ``sink`` until the stream ends (the
    service exited), then close it."""
    try:
        for line in itertools.chain(said, stream):
            sink.write(line)
            sink.flush()
    except (OSError, ValueError):
        pass  # the launcher's stderr is gone (closed at exit): nothing left to tell
    finally:
        stream.close()


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
