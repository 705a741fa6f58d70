"""``distune-run`` as a subprocess watched from outside, as a user's tools would watch it.

:class:`LauncherProcess` starts the launcher with a marker in the environment of every process
it starts, collects its output line by line, and afterwards says (and kills) what the job left
behind. The launcher's end-to-end tests and the fault benchmark (benchmarks/faults/job.py)
both watch jobs through it; benchmarks may import this package, tests never import benchmarks.
"""

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
from pathlib import Path

from distune.launcher.plan import UNSHARED_STORE
from tests.support.local_host import free_port, is_running

REPO = Path(__file__).resolve().parents[2]
MARKER = "DISTUNE_FAULTS_MARKER"
#: Tuning short enough that a job of ~15 s samples, switches and completes: a close call's
#: sample (best against default) lasts two sampling times, not the default twenty.
FAST_TUNING = (
    "--autotune_warmup_time", "1",
    "--autotune_sampling_confidence_time", "1",
    "--autotune_max_samples", "4",
    "--autotune_close_call_time", "2",
)  # fmt: skip


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
