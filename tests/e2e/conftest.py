"""Running ``distune-run`` as a real subprocess and watching what it leaves behind."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from benchmarks.faults.job import MARKER, processes_with

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
SCRIPTS = Path(__file__).resolve().parent / "scripts"
# A small MLP: 6 groups from 2^16 to 2^21 bytes, a few ms a step.
SMALL_MLP = [str(EXAMPLES / "train_mlp.py"), "--width", "256", "--depth", "3", "--log-every", "0.5"]
# Short tuning: windows of 0.25 s, so a job of ~15 s tunes several groups.
FAST_TUNING = [
    "--autotune_warmup_time", "1",
    "--autotune_sampling_confidence_time", "1",
    "--autotune_max_samples", "4",
]  # fmt: skip


class Launcher:
    """A ``distune-run`` subprocess whose combined output is collected line by line."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None) -> None:
        self.marker = uuid.uuid4().hex
        environment = {**os.environ, MARKER: self.marker, "DISTUNE_SYNC_INTERVAL": "0.25"}
        environment.pop("DISTUNE_SERVICE_TOKEN", None)
        environment.update(env or {})
        self.process = subprocess.Popen(
            [sys.executable, "-m", "distune.run", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
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

    @property
    def output(self) -> str:
        """Everything printed so far."""
        with self._changed:
            return "\n".join(self.lines)

    def wait_for(self, pattern: str, timeout: float) -> re.Match[str]:
        """The first output line matching ``pattern``; fails the test after ``timeout``."""
        deadline = time.monotonic() + timeout
        regex = re.compile(pattern)
        with self._changed:
            while True:
                for line in self.lines:
                    if match := regex.search(line):
                        return match
                remaining = deadline - time.monotonic()
                if remaining <= 0 or (
                    self.process.poll() is not None and not self._reader.is_alive()
                ):
                    pytest.fail(f"no line matching {pattern!r} in:\n{chr(10).join(self.lines)}")
                self._changed.wait(min(remaining, 0.2))

    def wait(self, timeout: float) -> int:
        """The exit code; fails the test (killing the tree) if it takes longer than ``timeout``."""
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill_all()
            pytest.fail(f"distune-run did not finish in {timeout} s:\n{self.output}")
        self._reader.join(5)
        return code

    def kill_all(self) -> None:
        """SIGKILL everything this launch started (test cleanup)."""
        for pid in [self.process.pid, *processes_with(self.marker)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.process.wait(10)

    def service_url(self, timeout: float = 60.0) -> str:
        """The URL the launcher printed for its tuning service."""
        return self.wait_for(r"tuning service at (http://\S+)", timeout).group(1)

    def leftovers(self, grace: float = 5.0) -> list[int]:
        """Processes of this launch still alive after ``grace`` seconds."""
        deadline = time.monotonic() + grace
        while (alive := processes_with(self.marker)) and time.monotonic() < deadline:
            time.sleep(0.1)
        return alive


@pytest.fixture
def launch() -> Iterator[type[Launcher]]:
    """Start launchers; whatever they leave behind is killed at the end of the test."""
    started: list[Launcher] = []

    def start(argv: list[str], env: dict[str, str] | None = None) -> Launcher:
        launcher = Launcher(argv, env)
        started.append(launcher)
        return launcher

    yield start  # type: ignore[misc]
    for launcher in started:
        if launcher.process.poll() is None or processes_with(launcher.marker):
            launcher.kill_all()
