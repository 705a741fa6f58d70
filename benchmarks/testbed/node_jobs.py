"""Running one command on every node of a testbed at once, each node's output in its own file.

A distributed job whose node fails leaves the other nodes waiting in a collective, so once one
node exits with an error the others get ``failure_grace`` seconds to finish on their own before
they are stopped. Stopping is SIGTERM to the command's process group, then SIGKILL.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO

from benchmarks.testbed.network import Node

#: Seconds a stopped command gets between SIGTERM and SIGKILL.
_STOP_GRACE = 5.0
_POLL = 0.05


@dataclass(frozen=True)
class NodeResult:
    """How one node's command ended.

    ``returncode`` is negative when a signal ended it (as in :mod:`subprocess`); ``stopped``
    says why the testbed stopped it ("timeout", "peer failed", "interrupted"), None when it
    ended by itself.
    """

    rank: int
    command: tuple[str, ...]
    returncode: int
    seconds: float
    output: Path
    stopped: str | None = None

    @property
    def ok(self) -> bool:
        """Whether the command ended by itself with exit code 0."""
        return self.returncode == 0 and self.stopped is None

    def read_output(self) -> str:
        """Everything the command printed (stdout and stderr, interleaved)."""
        return self.output.read_text(errors="replace")


def node0_result(results: Sequence[NodeResult], marker: str, job: str = "") -> dict:
    """The JSON object node 0 printed on its one line starting with ``marker``, once every node
    ended ok; a failed node raises naming the ``job`` and the node's log."""
    failed = [result for result in results if not result.ok]
    if failed:
        where = f"{job}: " if job else ""
        raise RuntimeError(f"{where}node{failed[0].rank} failed, see {failed[0].output}")
    (line,) = [
        line[len(marker) :]
        for line in results[0].read_output().splitlines()
        if line.startswith(marker)
    ]
    return json.loads(line)


def run_on_nodes(
    nodes: Sequence[Node],
    command: Callable[[Node], Sequence[str]],
    *,
    output_dir: Path,
    timeout: float,
    env: Mapping[str, str] | None = None,
    failure_grace: float = 15.0,
    echo: bool = False,
) -> list[NodeResult]:
    """Run ``command(node)`` on every node at once; wait for all; one result per node.

    Output goes to ``output_dir/node<rank>.log`` (also to stdout, prefixed, with ``echo``) and a
    summary to ``output_dir/results.json``. Every process gets the node's environment and
    ``env``. After ``timeout`` seconds the commands still running are stopped. An exception or
    interrupt while waiting stops them all before it propagates.
    """
    if timeout <= 0 or failure_grace < 0:
        raise ValueError(
            f"timeout must be positive and failure_grace >= 0: {timeout}, {failure_grace}"
        )
    output_dir.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    runs: list[_Run] = []
    try:
        for node in nodes:
            runs.append(_Run.start(node, tuple(command(node)), output_dir, env, echo))
        _wait(runs, start + timeout, failure_grace)
    finally:
        for run in runs:
            if run.poll() is None:
                run.stop("interrupted")
        for run in runs:
            run.finish()
    results = [run.result(start) for run in runs]
    summary = [{**asdict(result), "output": str(result.output)} for result in results]
    (output_dir / "results.json").write_text(json.dumps(summary, indent=2) + "\n")
    return results


def _wait(runs: list[_Run], deadline: float, failure_grace: float) -> None:
    peer_deadline: float | None = None
    while any(run.poll() is None for run in runs):
        now = time.monotonic()
        if peer_deadline is None and any(run.poll() not in (None, 0) for run in runs):
            peer_deadline = now + failure_grace
        reason = "timeout" if now >= deadline else None
        if reason is None and peer_deadline is not None and now >= peer_deadline:
            reason = "peer failed"
        if reason:
            for run in runs:
                if run.poll() is None:
                    run.stop(reason)
            return
        time.sleep(_POLL)


class _Run:
    """One node's process, its log file and, with echo, the thread that copies its output."""

    def __init__(
        self,
        node: Node,
        command: tuple[str, ...],
        process: subprocess.Popen,
        log: IO[bytes],
        path: Path,
        echo_thread: threading.Thread | None,
    ) -> None:
        self.node = node
        self.command = command
        self.process = process
        self.log = log
        self.path = path
        self.echo_thread = echo_thread
        self.stopped: str | None = None
        self.ended: float | None = None

    @classmethod
    def start(
        cls,
        node: Node,
        command: tuple[str, ...],
        output_dir: Path,
        env: Mapping[str, str] | None,
        echo: bool,
    ) -> _Run:
        path = output_dir / f"node{node.rank}.log"
        log = path.open("wb")
        process = node.popen(
            command,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE if echo else log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: stopping it reaches its children
        )
        thread = None
        if echo:
            thread = threading.Thread(target=_copy, args=(process, log, node.rank), daemon=True)
            thread.start()
        return cls(node, command, process, log, path, thread)

    def poll(self) -> int | None:
        """The exit code once the process has ended, noting when it was first seen ended."""
        code = self.process.poll()
        if code is not None and self.ended is None:
            self.ended = time.monotonic()
        return code

    def stop(self, reason: str) -> None:
        self.stopped = reason
        for signum in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signum)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(_STOP_GRACE)
                return

    def finish(self) -> None:
        self.process.wait()
        self.poll()
        if self.echo_thread is not None:
            self.echo_thread.join(_STOP_GRACE)
        self.log.close()

    def result(self, start: float) -> NodeResult:
        return NodeResult(
            rank=self.node.rank,
            command=self.command,
            returncode=self.process.returncode,
            seconds=round((self.ended or start) - start, 3),
            output=self.path,
            stopped=self.stopped,
        )


def _copy(process: subprocess.Popen, log: IO[bytes], rank: int) -> None:
    assert process.stdout is not None
    prefix = f"[node{rank}] ".encode()
    for line in process.stdout:
        log.write(line)
        log.flush()
        sys.stdout.buffer.write(prefix + line)
        sys.stdout.buffer.flush()
