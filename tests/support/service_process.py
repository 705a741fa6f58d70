"""``python -m distune.tuning_service`` as a child process, for tests that need the real one.

:class:`ServiceProcess` starts it with a token in its environment (never on its command line),
reads the one-line announcement for its URL, talks to it with the token, and stops it with a
signal, keeping what it wrote. What it writes is read as it comes: a service that logs more than
a pipe holds (64 KiB: a few hundred samples' lines) would otherwise block in its logger and stop
answering. The ``start_service`` fixture of tests/conftest.py stops every one a test started.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from typing import IO, Any

import requests

#: The token a test's service gets unless the test gives another.
TOKEN = "test-service-token"


class ServiceProcess:
    """The tuning service in a child process on a free port; ``args`` are its other flags."""

    def __init__(self, *args: str, token: str | None = TOKEN) -> None:
        env = {name: value for name, value in os.environ.items() if name != "DISTUNE_SERVICE_TOKEN"}
        if token is not None:
            env["DISTUNE_SERVICE_TOKEN"] = token
        self.token = token
        self.output: tuple[str, str] = ("", "")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "distune.tuning_service", "--port", "0", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            text=True,
        )
        self._stderr = _Drain(self.process.stderr)
        assert self.process.stdout is not None
        line = self.process.stdout.readline()  # bounded by the test's timeout
        self._stdout = _Drain(self.process.stdout)
        if not line:
            self.stop()
            raise RuntimeError(f"the service did not start: {self.output[1]}")
        self.announcement: dict[str, Any] = json.loads(line)
        self.url: str = self.announcement["url"]
        self.session = requests.Session()
        if token is not None:
            self.session.headers["Authorization"] = f"Bearer {token}"

    def get(self, path: str) -> requests.Response:
        """GET ``path`` (``/api/v1/...``) with the token."""
        return self.session.get(self.url + path, timeout=10)

    def post(self, path: str, body: Any) -> requests.Response:
        """POST ``body`` as JSON to ``path`` with the token."""
        return self.session.post(self.url + path, json=body, timeout=10)

    def stop(self, sig: int = signal.SIGTERM) -> int:
        """Send ``sig``; the exit code. The rest of stdout and stderr land in ``self.output``."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.output = (self._stdout.text(), self._stderr.text())
        return self.process.returncode


class _Drain:
    """Reads a child's pipe to its end in a thread; :meth:`text` is all it read."""

    def __init__(self, pipe: IO[str] | None) -> None:
        assert pipe is not None
        self._chunks: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(pipe,), daemon=True)
        self._thread.start()

    def _read(self, pipe: IO[str]) -> None:
        with pipe:
            for chunk in iter(lambda: pipe.read(65536), ""):
                self._chunks.append(chunk)

    def text(self) -> str:
        """What the pipe carried; call once the child has exited."""
        self._thread.join(timeout=15)
        return "".join(self._chunks)
