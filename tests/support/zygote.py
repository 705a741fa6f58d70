"""``python SCRIPT ARGS`` forked from a process that has already imported torch.

Importing torch takes a process seconds on a loaded machine, often longer than what the test
runs in it. A zygote is a Python process that imports ``PRELOAD`` once, then forks a child per
request; the child sets the request's environment, arguments and output files, and runs the
script as ``python SCRIPT ARGS`` would: as ``__main__``, its directory first on ``sys.path``, its
output buffered as Python buffers it (unbuffered under ``PYTHONUNBUFFERED``), the exit code and
traceback of an uncaught exception. The integration tests' 2-rank jobs fork each rank from a
zygote of its own (tests/integration/ddp_launch.py), so the ranks of one job still hash strings
with different seeds, as fresh processes do; ``run_python`` is ``subprocess.run`` of a script.

Run as a script, this file is the zygote: it reads one JSON request per line on stdin, answers
the child's pid on stdout, and writes the child's exit code (negative: the signal) to the
request's status file when it ends. It ends when its stdin closes (the test session ended).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import io
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

#: What every worker script imports first (torch._dynamo: with its first optimizer step), and
#: what takes it seconds.
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "pytest")


class ForkedRank:
    """One rank forked by a zygote: ``poll``, ``kill`` and ``wait`` as ``subprocess.Popen``'s."""

    def __init__(self, pid: int, status: Path) -> None:
        self.pid = pid
        self._status = status
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """The exit code once the zygote has reaped the rank, else None."""
        if self.returncode is None and self._status.exists():
            self.returncode = int(self._status.read_text())
        return self.returncode

    def kill(self) -> None:
        """SIGKILL the rank (it is the zygote's child, not ours: by pid, while not reaped)."""
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)

    def wait(self, timeout: float = 30.0) -> int:
        """The exit code; raises if the zygote has not reaped the rank in ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank pid {self.pid} did not end in {timeout} s")
            time.sleep(0.02)
        assert self.returncode is not None
        return self.returncode


class Zygote:
    """A zygote process (started here) and the requests sent to it, one at a time (a test may
    run two jobs at once, from two threads)."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self._lock = threading.Lock()
        self._errors: IO[bytes] = tempfile.TemporaryFile()  # noqa: SIM115 (lives with the zygote)
        self._process = subprocess.Popen(
            [sys.executable, __file__, *PRELOAD],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._errors,
            env=dict(env),
            text=True,
        )

    def fork(
        self, argv: list[str], env: Mapping[str, str], log: Path, errors: Path | None = None
    ) -> ForkedRank:
        """Start ``python ARGV`` (as a fork) with environment ``env``, its stdout to ``log`` and
        its stderr to ``errors`` (None: to ``log`` too)."""
        status = log.with_name(log.name + ".exit")
        status.unlink(missing_ok=True)
        for path in {log, errors or log}:
            path.write_bytes(b"")  # the child appends: stdout and stderr may share the file
        request = {
            "argv": argv,
            "env": dict(env),
            "cwd": os.getcwd(),
            "log": str(log),
            "errors": str(errors or log),
        }
        assert self._process.stdin is not None and self._process.stdout is not None
        with self._lock:
            try:
                self._process.stdin.write(json.dumps({**request, "status": str(status)}) + "\n")
                self._process.stdin.flush()
                answer = self._process.stdout.readline()
            except BrokenPipeError:
                answer = ""
        if not answer:
            self._errors.seek(0)
            said = self._errors.read().decode(errors="replace")
            raise RuntimeError(f"the rank zygote ended (exit {self._process.poll()}):\n{said}")
        return ForkedRank(int(answer), status)


def _stream(fd: int, unbuffered: bool, line_buffering: bool, errors: str) -> io.TextIOWrapper:
    """``sys.stdout`` or ``sys.stderr`` of a fresh ``python`` writing to a file: unbuffered
    under PYTHONUNBUFFERED, else stdout block-buffered and stderr line-buffered."""
    raw = io.FileIO(fd, "w", closefd=False)
    if unbuffered:
        return io.TextIOWrapper(raw, encoding="utf-8", errors=errors, write_through=True)
    return io.TextIOWrapper(
        io.BufferedWriter(raw), encoding="utf-8", errors=errors, line_buffering=line_buffering
    )


def _run_child(request: dict[str, Any]) -> None:
    """In the forked child: become ``python ARGV`` with the request's environment; never
    returns."""
    code = 1
    try:
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        for fd, path in ((1, request["log"]), (2, request["errors"])):
            opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(opened, fd)
            os.close(opened)
        os.environ.clear()
        os.environ.update(request["env"])
        unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
        sys.stdout = _stream(1, unbuffered, line_buffering=False, errors="strict")
        sys.stderr = _stream(2, unbuffered, line_buffering=True, errors="backslashreplace")
        os.chdir(request["cwd"])
        script = os.path.abspath(request["argv"][0])
        sys.argv = list(request["argv"])
        sys.path[0] = os.path.dirname(script)
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as exit:
        if isinstance(exit.code, int) or exit.code is None:
            code = exit.code or 0
        else:
            print(exit.code, file=sys.stderr)
    except BaseException:
        sys.excepthook(*sys.exc_info())  # as the interpreter: a script's own hook runs
    finally:
        _finalize(code)


def _finalize(code: int) -> None:
    """End the child as the interpreter ends: wait for its threads, run its atexit callbacks,
    flush its output; then exit without running the zygote's own finalization."""
    with contextlib.suppress(BaseException):
        threading._shutdown()  # type: ignore[attr-defined]
    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()
    with contextlib.suppress(BaseException):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


@functools.cache
def _script_zygote() -> Zygote:
    """The zygote of ``run_python``, started at its first call; it ends with the session."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DISTUNE_", "TORCHELASTIC"))}
    return Zygote(env)


def run_python(
    argv: list[str], env: Mapping[str, str], timeout: float
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True,
    timeout=timeout)``, forked from a zygote whose environment is this process's without
    distune's variables."""
    with tempfile.TemporaryDirectory() as folder:
        out, err = Path(folder) / "stdout", Path(folder) / "stderr"
        child = _script_zygote().fork(argv, env, out, err)
        deadline = time.monotonic() + timeout
        while child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        if child.poll() is None:
            child.kill()
            child.wait()
            raise subprocess.TimeoutExpired(argv, timeout, out.read_text(), err.read_text())
        return subprocess.CompletedProcess(argv, child.wait(), out.read_text(), err.read_text())


def _serve() -> None:
    """The zygote's loop: fork a child per request, reap children, write their exit codes."""
    for name in sys.argv[1:]:
        __import__(name)
    children: dict[int, str] = {}
    while True:
        ready, _, _ = select.select([sys.stdin], [], [], 0.05)
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            path = children.pop(pid, None)
            if path is not None:
                Path(path + ".tmp").write_text(str(os.waitstatus_to_exitcode(status)))
                os.replace(path + ".tmp", path)
        if not ready:
            continue
        line = sys.stdin.readline()
        if not line:
            return  # the test session ended
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _run_child(request)
        children[pid] = request["status"]
        print(pid, flush=True)


if __name__ == "__main__":
    _serve()
