"""SIGTERM, SIGINT, SIGHUP and SIGQUIT to the launcher: stop everything, even where Python
cannot listen.

Python runs a signal handler only when the main thread is back in the interpreter. torch's
elastic agent spends its rendezvous inside C++ (a TCPStore waiting for the other nodes), where a
signal waits until the store gives up, by default many minutes later: node 0 of a multi-node job
whose other nodes never come would ignore Ctrl-C and keep its tuning service and port that long.

:class:`StopSignals` installs handlers that raise torch's ``SignalException`` in the main thread
(torch's agent installs the same ones while workers run, and stops them on it), and a watchdog
thread that learns of every signal through :func:`signal.set_wakeup_fd`, which the interpreter
writes to from the C-level handler whatever the main thread is doing. If, after a stop signal,
the launcher has not begun its own cleanup and has had no worker process for ``grace`` seconds,
nothing is left that needs an orderly stop: the watchdog runs the emergency stop (stopping the
service) and ends the process with exit code 128 + the signal's number.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Collection
from pathlib import Path
from types import FrameType

from torch.distributed.elastic.multiprocessing import SignalException

#: torchrun's own stop signals (its ``--signals_to_handle`` default): SIGQUIT (Ctrl-\) too,
#: which would otherwise end the launcher with a core dump and leave a level-2 trial running.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
#: Seconds without workers and without cleanup, after a stop signal, before the watchdog acts.
DEFAULT_GRACE = 5.0
_POLL = 0.1


def _raise_signal(signum: int, frame: FrameType | None) -> None:
    # The same exception torch's elastic agent raises once it runs, so one handler covers both.
    raise SignalException(f"distune-run got {signal.Signals(signum).name}", signal.Signals(signum))


def child_pids() -> set[int]:
    """The pids of this process's children (every thread's), from /proc; empty where absent."""
    pids: set[int] = set()
    for children in Path("/proc/self/task").glob("*/children"):
        with contextlib.suppress(OSError, ValueError):
            pids.update(int(pid) for pid in children.read_text().split())
    return pids


class StopSignals:
    """Stop-signal handling for one launch: :meth:`install` first, in the main thread; then
    :meth:`watch` once helper processes (the service) have started; :meth:`cleanup_started`
    when the launcher begins to stop, whatever the reason."""

    def __init__(self, grace: float = DEFAULT_GRACE) -> None:
        self._grace = grace
        self._cleaning = threading.Event()
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)  # set_wakeup_fd requires it

    def install(self) -> None:
        """Raise ``SignalException`` on a stop signal; note every signal for the watchdog."""
        for stop_signal in STOP_SIGNALS:
            signal.signal(stop_signal, _raise_signal)
        signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)

    def watch(self, emergency_stop: Callable[[], None], helpers: Collection[int] = ()) -> None:
        """Start the watchdog; ``helpers`` are child pids that are not workers (the service)."""
        thread = threading.Thread(
            target=self._watch, args=(emergency_stop, frozenset(helpers)), daemon=True
        )
        thread.name = "distune-stop-watchdog"
        thread.start()

    def cleanup_started(self) -> None:
        """The launcher is stopping in order: ignore further stop signals, stand the watchdog
        down (cleanup is bounded in time; a second Ctrl-C must not leave the service behind)."""
        self._cleaning.set()
        for stop_signal in STOP_SIGNALS:
            signal.signal(stop_signal, signal.SIG_IGN)

    def _watch(self, emergency_stop: Callable[[], None], helpers: frozenset[int]) -> None:
        received = self._next_stop_signal()
        quiet_since = time.monotonic()
        while not self._cleaning.wait(_POLL):
            if child_pids() - helpers:
                quiet_since = time.monotonic()  # workers run: torch's agent stops them
            elif time.monotonic() - quiet_since >= self._grace:
                print(
                    f"distune-run: stopping on {received.name}; the rendezvous did not return, "
                    "so the launcher stops its tuning service and exits",
                    file=sys.stderr,
                    flush=True,
                )
                emergency_stop()
                os._exit(128 + received)

    def _next_stop_signal(self) -> signal.Signals:
        while True:
            for number in os.read(self._read_fd, 64):
                if number in STOP_SIGNALS:
                    return signal.Signals(number)
