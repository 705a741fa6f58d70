"""Running one level-2 trial as a real job of all ranks, and telling what happened.

The trial is ``distune.launcher.trial_job`` (torch's elastic launcher) in a session of its own,
with the configuration in ``DISTUNE_*`` variables and max_restarts 0. A watchdog reads the
progress file the node's first rank rewrites after every optimizer step: no new step within the
trial time-out (start-up included) stops the trial as ``timeout``. Stopping is by ids: SIGTERM
to the agent (which stops its ranks), then SIGKILL to the agent and every rank it started,
found in /proc and in the pid files the ranks wrote. The outcome comes from the structured
files the ranks write (:mod:`distune.worker_runtime.trial_measurement`) and the exit status,
never from the text of the log. On a multi-node job every node's launcher runs its own ranks of
the trial this way (its watchdog reading its node's first rank's progress), and stops them early
when the service says a peer node failed or the trial was closed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import get_args_parser

from distune.trial_settings import PROGRESS_FILE, RESULT_FILE, TRIAL_DIR, TrialSettings
from distune.tuning_service.trials.trial_result import CRASH, INVALID, OK, OOM, TIMEOUT
from distune.worker_settings import SERVICE_TOKEN, SERVICE_URL, WorkerSettings

#: Exit statuses of a rank the kernel's out-of-memory killer ended (SIGKILL).
OOM_EXIT_CODES = (137, -9)
_POLL = 0.2
#: A trial's collectives time out after this many trial time-outs (a backstop to the watchdog).
COLLECTIVE_TIMEOUT_FACTOR = 2.0
#: Seconds between two questions to the service whether the trial goes on.
_ABORT_POLL = 0.5
_STOP_GRACE = 5.0
_LOG_TAIL_LINES = 12
#: A trial's combined output, and the folder of each rank's own (torch's ``--log-dir`` layout).
LOG_FILE = "log.txt"
RANK_LOGS = "ranks"
#: The first failed rank of a trial (its rank, local rank and exit code), from trial_job.
FAILURE_FILE = "failure.json"


@dataclass(frozen=True)
class TrialRun:
    """What one trial did on this node: its outcome, rank 0's measurements if ok (node 0
    only), why if not; ``stopped`` says why the launcher stopped it early (a peer failed, the
    trial was closed), None if it ran to its end or its own watchdog."""

    outcome: str
    exit_code: int | None
    measurements: dict[str, Any] | None
    error: str | None
    duration: float
    log_path: Path
    peak_memory_bytes: int | None = None
    stopped: str | None = None
    #: The optimizer steps the node's first rank finished under distune (its progress file);
    #: None where none did (the script never reached distune, or failed before a step).
    steps: int | None = None
    #: When the node's first failing rank failed (seconds since the epoch), for an oom or a
    #: crash: of two nodes that failed, the first is the cause (:func:`failed_at`).
    failed_at: float | None = None
    #: Whether it crashed because the model's parameters went NaN or inf (its ranks said so).
    diverged: bool = False


def failure_exit_code(error: ChildFailedError) -> int:
    """The exit code of the first failed rank, as a shell reports it (128 + N for signal N)."""
    _, failure = error.get_first_failure()
    return failure.exitcode if failure.exitcode > 0 else 128 - failure.exitcode


def read_json_object(path: Path) -> dict[str, Any] | None:
    """The JSON object a rank wrote at ``path``, or None where it is missing, half-written or
    not an object (a rank may die mid-write; the caller classifies what is there)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def classify(
    exit_code: int | None,
    timed_out: bool,
    rank_reports: list[dict[str, Any]],
    result: dict[str, Any] | None,
    log_tail: str,
    expects_result: bool = True,
) -> tuple[str, str | None]:
    """The outcome and its explanation, from the exit status and the ranks' own reports.

    ``oom`` wins over everything (any rank's report, or a rank killed by the kernel): a rank
    that ran out of memory makes its peers fail in their collectives, and those are symptoms.
    Only node 0 has rank 0's ``result``; another node (``expects_result`` False) is ok when its
    job ended well and each of its ranks reported ok.
    """
    for report in rank_reports:
        if report.get("outcome") == OOM:
            return OOM, report.get("error")
    if timed_out:
        return TIMEOUT, "no finished step within the trial time-out"
    if exit_code in OOM_EXIT_CODES:
        return OOM, f"a rank was killed (exit {exit_code}), as the kernel's OOM killer does"
    crashes = [r for r in rank_reports if r.get("outcome") == CRASH]
    if crashes:
        # The first rank to fail is the cause: the others failed in a collective with it
        # ("Connection closed by peer"). A report without a time sorts last.
        first = min(
            crashes, key=lambda r: r["time"] if isinstance(r.get("time"), float) else math.inf
        )
        return CRASH, first.get("error")
    if exit_code == 0 and result is not None and result.get("outcome") == OK:
        return OK, None
    all_ok = bool(rank_reports) and all(r.get("outcome") == OK for r in rank_reports)
    if not expects_result and exit_code == 0 and all_ok:
        return OK, None
    if exit_code == 0:
        return INVALID, (
            "the script ended without finishing the trial's steps: does it call distune.prepare "
            "and train for at least the warm-up and measured steps?"
        )
    return CRASH, log_tail or f"exit status {exit_code}"


def finished_steps(progress: Path) -> int | None:
    """The optimizer steps the node's first rank has finished, from the progress file it
    rewrites after each; None before the first (or where the script never reached distune)."""
    data = read_json_object(progress)
    steps = None if data is None else data.get("steps")
    return steps if isinstance(steps, int) else None


def too_few_steps(steps: int | None, settings: TrialSettings) -> str | None:
    """Why a trial whose script took part (it finished ``steps`` steps) ended with status 0
    and no result: it ran out of steps (its own ``--steps``, ``--max_steps`` or epochs) before
    the warm-up and measured steps; None where no step finished."""
    if steps is None:
        return None
    needed = settings.warmup_steps + settings.measured_steps
    return (
        f"the script ended after {steps} optimizer step(s); a trial runs {needed} ("
        f"{settings.warmup_steps} warm-up, {settings.measured_steps} measured): give it at least "
        f"{needed} in level 2 (its own steps, max_steps or epochs flag)"
    )


def stalled(steps: int | None, timeout: float) -> str:
    """Why the watchdog stopped a trial whose script reached distune: the steps it finished,
    and the flag that gives a slow step more time."""
    when = f"after step {steps}" if steps is not None else "before the first step"
    return (
        f"no step finished for {timeout:g} s {when}: a hang, or a step slower than that "
        "(torch.compile's first steps compile); --autotune_trial_timeout gives steps more time"
    )


def descendants(pid: int) -> set[int]:
    """The pids of ``pid``'s children, theirs, and so on, from /proc (empty where absent)."""
    found: set[int] = set()
    pending = [pid]
    while pending:
        parent = pending.pop()
        for children in Path(f"/proc/{parent}/task").glob("*/children"):
            with contextlib.suppress(OSError, ValueError):
                for child in map(int, children.read_text().split()):
                    if child not in found:
                        found.add(child)
                        pending.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _belongs(pid: int, trial_dir: Path) -> bool:
    """Whether ``pid`` is still one of this trial's ranks (a pid may be reused once it ends)."""
    marker = f"{TRIAL_DIR}={trial_dir}".encode()
    try:
        return marker in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False


def _live_session(pid: int) -> int | None:
    """The session id of ``pid`` (the fourth field after the command in /proc's stat), or None
    where it is gone or a zombie (dead: its parent has yet to reap it)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return None if fields[0] == "Z" else int(fields[3])
    except (OSError, IndexError, ValueError):
        return None


def trial_sessions(trial_pid: int, trial_dir: Path) -> frozenset[int]:
    """The sessions of a trial: its job's (started as a session of its own) and each measured
    rank's (torch's agent starts every rank as a session of its own; a rank writes its pid
    file once distune measures it)."""
    sessions = {trial_pid}
    for pid_file in trial_dir.glob("pid.*"):
        with contextlib.suppress(OSError, ValueError):
            sessions.add(int(pid_file.read_text()))
    return frozenset(sessions)


def left_running(trial_dir: Path, sessions: frozenset[int] = frozenset()) -> set[int]:
    """The processes still carrying this trial's ``DISTUNE_TRIAL_DIR``, or still in one of its
    ``sessions`` (:func:`trial_sessions`), found in /proc (empty where absent) once its ranks
    ended: what a rank started and left behind (a helper server the script stops in a
    ``finally``, DataLoader workers), since a measured rank ends at once with ``os._exit``,
    and neither its ``finally`` blocks nor its atexit handlers run. The session finds a helper
    started with an environment of its own (``Popen(..., env={...})``), which the variable
    misses; one that left the session (a daemon's ``setsid``) keeps the variable unless it
    also replaced its environment. A session id outlives its leader; it could name another
    process's only if the leader's pid were reused, between the trial's end and this sweep,
    by a new session leader."""
    found: set[int] = set()
    with contextlib.suppress(OSError):
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            pid = int(entry.name)
            if _belongs(pid, trial_dir) or (sessions and _live_session(pid) in sessions):
                found.add(pid)
    return found


def read_log_tail(path: Path) -> str:
    """The last lines of a log (empty where it cannot be read)."""
    with contextlib.suppress(OSError):
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        return "\n".join(lines[-_LOG_TAIL_LINES:])
    return ""


def _first_failure_logs(trial_dir: Path) -> list[Path]:
    failure = read_json_object(trial_dir / FAILURE_FILE)
    if failure is None:
        return []
    local_rank = failure.get("local_rank")
    return sorted(trial_dir.glob(f"{RANK_LOGS}/*/attempt_0/{local_rank}/stderr.log"))


def first_failure_time(trial_dir: Path) -> float | None:
    """When the first failed rank wrote its stderr last (seconds since the epoch): its
    failure's time where it wrote no report (``sys.exit("...")`` prints as it ends); None
    where the trial job recorded no failure."""
    for stderr in _first_failure_logs(trial_dir):
        with contextlib.suppress(OSError):
            return stderr.stat().st_mtime
    return None


def failed_at(
    outcome: str, reports: list[dict[str, Any]], unreported: bool, trial_dir: Path
) -> float | None:
    """When this node's trial failed as ``outcome``: the earliest report of it, or, where its
    first failed rank wrote none (``unreported``), that rank's last output; None where no
    failure says when (an ok trial, a time-out)."""
    if unreported:
        return first_failure_time(trial_dir)
    times = [
        r["time"]
        for r in reports
        if r.get("outcome") == outcome and isinstance(r.get("time"), int | float)
    ]
    return float(min(times)) if times and outcome in (OOM, CRASH) else None


def first_failure_stderr(trial_dir: Path) -> str | None:
    """The first failed rank's own stderr tail, with its rank and exit status (None where the
    trial job recorded no failure, or the rank wrote nothing to stderr)."""
    failure = read_json_object(trial_dir / FAILURE_FILE)
    if failure is None:
        return None
    for stderr in _first_failure_logs(trial_dir):
        tail = read_log_tail(stderr)
        if tail:
            return (
                f"rank {failure.get('rank')} exited with status {failure.get('exit_code')}; "
                f"its stderr ends:\n{tail}"
            )
    return None


def failure_tail(trial_dir: Path) -> str:
    """What a crash's error carries where no rank reported why (it failed before distune could
    see it: at import, in its argument parser): the first failed rank's own stderr tail, so the
    user sees its traceback without opening the log; else the tail of the trial's log."""
    return first_failure_stderr(trial_dir) or read_log_tail(trial_dir / LOG_FILE)


def unreported_first_failure(trial_dir: Path, reports: list[dict[str, Any]]) -> str | None:
    """Where the first rank to fail wrote no report of its own while others did (it ended
    through ``sys.exit`` or a signal, which no excepthook sees, and its peers then crashed in
    their collectives with it): its own stderr tail, the cause; else None. torch's agent
    records the failures it finds first before the ranks it stops, so a stopped rank is never
    the first."""
    failure = read_json_object(trial_dir / FAILURE_FILE)
    if failure is None or any(r.get("rank") == failure.get("rank") for r in reports):
        return None
    return first_failure_stderr(trial_dir)


def ended_early(trial_dir: Path) -> str | None:
    """Where ranks of this node had exited with status 0 before another failed (the
    ``ended`` of ``failure.json``): what that says, else None. Such a rank's script left
    its loop early, and the others failed in their next collective: the cause, not their
    errors."""
    failure = read_json_object(trial_dir / FAILURE_FILE) or {}
    ended = failure.get("ended")
    if not ended or not isinstance(ended, list):
        return None
    ranks = f"rank{'s' if len(ended) > 1 else ''} {', '.join(map(str, ended))}"
    return (
        f"{ranks} exited with status 0 while the others trained (the script ended early "
        f"there), so rank {failure.get('rank')} failed in a collective; every rank must run "
        "the trial's steps"
    )


class TrialRunner:
    """Runs trials of one script with the job's torchrun arguments."""

    def __init__(self, args: argparse.Namespace, trial_timeout: float, root: Path) -> None:
        self.args = args
        self.trial_timeout = trial_timeout
        # Absolute: the ranks write into their trial's directory after the script may have
        # changed its working directory (Hydra's job.chdir, an os.chdir to its output dir).
        self.root = root.absolute()

    def _spec(self, script_args: list[str], master_port: int, trial_dir: Path) -> dict[str, Any]:
        # torchrun's own arguments only (distune's flags are the launcher's business).
        torchrun_dests = {action.dest for action in get_args_parser()._actions}
        spec = {k: v for k, v in vars(self.args).items() if k in torchrun_dests}
        spec["training_script_args"] = script_args
        spec["max_restarts"] = 0  # a failing trial is an outcome, not something to retry
        # Each rank's output in a file of its own (a failed rank's explains it), and in the log.
        spec.update(log_dir=str(trial_dir / RANK_LOGS), redirects="3", tee="3")
        if spec.get("run_path"):
            # --run-path runs the script in a multiprocessing child whose agent waits for a
            # return value that a trial's rank, ending once measured, never sends: the trial
            # would hang to its time-out. The script runs the same as its own interpreter.
            spec.update(run_path=False, module=False)
        if spec.get("rdzv_backend") == "static" and not spec.get("standalone"):
            spec["master_port"] = master_port  # a fresh port: the last trial's may linger
        return spec

    def run(
        self,
        index: int,
        settings: TrialSettings,
        script_args: list[str],
        master_port: int,
        abort: Callable[[], str | None] | None = None,
    ) -> TrialRun:
        """Run this node's ranks of trial ``index`` to their end (or the time-out) and classify
        them. ``abort``, asked every half second, returns why to stop early (a peer node
        failed), or None to go on."""
        trial_dir = self.root / f"trial-{index:03d}"
        attempt = 1
        while trial_dir.exists():  # resuming in the same directory: keep the earlier logs
            attempt += 1
            trial_dir = self.root / f"trial-{index:03d}-{attempt}"
        trial_dir.mkdir(parents=True)
        spec_path = trial_dir / "torchrun.json"
        spec = self._spec(script_args, master_port, trial_dir)
        spec_path.write_text(json.dumps(spec), encoding="utf-8")
        # The ranks' own collective time-out backs up the watchdog (twice its time-out, so the
        # watchdog's `timeout` comes first): a rank whose launcher is gone still ends.
        backstop = math.ceil(COLLECTIVE_TIMEOUT_FACTOR * self.trial_timeout)
        settings = TrialSettings(
            **{**vars(settings), "trial_dir": trial_dir, "collective_timeout": backstop}
        )
        env = {k: v for k, v in os.environ.items() if k not in (SERVICE_URL, SERVICE_TOKEN)}
        env.update(WorkerSettings(autotune_level=0).to_env())  # no online tuning in a trial
        env.update(settings.to_env())
        log_path = trial_dir / LOG_FILE
        start = time.monotonic()
        timed_out, stopped = False, None
        with open(log_path, "wb") as log:
            process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "distune.launcher.trial_job",
                    str(spec_path),
                    str(os.getpid()),
                ],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
            try:
                timed_out, stopped = self._watch(process, trial_dir / PROGRESS_FILE, abort)
            finally:
                if process.poll() is None:
                    self._stop(process, trial_dir)
                self._end_left_running(trial_dir, trial_sessions(process.pid, trial_dir))
        exit_code = process.returncode
        reports = [r for p in sorted(trial_dir.glob("rank*.json")) if (r := read_json_object(p))]
        result = read_json_object(trial_dir / RESULT_FILE)
        outcome, error = classify(
            exit_code, timed_out, reports, result, failure_tail(trial_dir), self.node_rank == 0
        )
        unreported = unreported_first_failure(trial_dir, reports) if outcome == CRASH else None
        if unreported:
            error = unreported
        if outcome == CRASH and (early := ended_early(trial_dir)) is not None:
            error = f"{error}\n{early}" if error else early
        steps = finished_steps(trial_dir / PROGRESS_FILE)
        if outcome == INVALID:
            error = too_few_steps(steps, settings) or error
        if outcome == TIMEOUT:
            error = stalled(steps, self.trial_timeout)
        if outcome == TIMEOUT and not any(trial_dir.glob("pid.*")):
            # Each rank writes its pid file once distune measures it: none did.
            error = (
                "no rank reached distune.prepare or distune.DistributedDataParallel within the "
                f"trial time-out ({self.trial_timeout:g} s): the script hangs before it (in its "
                "start-up or its process group's rendezvous), or uses neither, or its start-up "
                "(loading data, say) takes longer than that: give --autotune_trial_timeout "
                "more seconds than it"
            )
        peaks = [int(r["peak_memory_bytes"]) for r in reports if r.get("peak_memory_bytes")]
        return TrialRun(
            outcome=outcome,
            exit_code=exit_code,
            measurements=result if outcome == OK else None,
            error=error if stopped is None else f"stopped: {stopped}; {error}",
            duration=time.monotonic() - start,
            log_path=log_path,
            peak_memory_bytes=max(peaks) if peaks else None,
            stopped=stopped,
            steps=steps,
            failed_at=failed_at(outcome, reports, unreported is not None, trial_dir),
            diverged=outcome == CRASH and any(r.get("diverged") is True for r in reports),
        )

    @property
    def node_rank(self) -> int:
        """This node's rank in the job (0 on a single node)."""
        return int(getattr(self.args, "node_rank", 0) or 0)

    def _watch(
        self,
        process: subprocess.Popen,
        progress: Path,
        abort: Callable[[], str | None] | None,
    ) -> tuple[bool, str | None]:
        """Wait for the trial; whether the watchdog fired, and why ``abort`` stopped it (in
        either case it is still running)."""
        last_steps, last_change = None, time.monotonic()
        last_asked = last_change
        while process.poll() is None:
            steps = finished_steps(progress)
            now = time.monotonic()
            if steps != last_steps:
                last_steps, last_change = steps, now
            elif now - last_change > self.trial_timeout:
                return True, None
            if abort is not None and now - last_asked >= _ABORT_POLL:
                last_asked = now
                reason = abort()
                if reason is not None:
                    return False, reason
            time.sleep(_POLL)
        return False, None

    def _end_left_running(self, trial_dir: Path, sessions: frozenset[int]) -> None:
        """Stop what the trial's ranks left running (:func:`left_running`), gently first."""
        pids = left_running(trial_dir, sessions)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + _STOP_GRACE
        while time.monotonic() < deadline and pids & left_running(trial_dir, sessions):
            time.sleep(_POLL / 4)
        for pid in left_running(trial_dir, sessions):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)

    def _stop(self, process: subprocess.Popen, trial_dir: Path) -> None:
        """Stop the trial's agent and ranks by their ids, gently first."""
        pids = descendants(process.pid)
        for pid_file in trial_dir.glob("pid.*"):
            with contextlib.suppress(OSError, ValueError):
                rank_pid = int(pid_file.read_text())
                if _belongs(rank_pid, trial_dir):  # orphaned if the agent died first
                    pids.add(rank_pid)
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + _STOP_GRACE
        while time.monotonic() < deadline and (
            process.poll() is None or any(_alive(p) for p in pids)
        ):
            pids |= descendants(process.pid) if process.poll() is None else set()
            time.sleep(_POLL)
        for pid in [process.pid, *pids]:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        process.wait()
