"""One level-2 trial's job: ``python -m distune.launcher.trial_job SPEC LAUNCHER_PID``.

The launcher starts this in a session of its own, so that it can stop the trial (this process,
torch's elastic agent, and the ranks it spawns) by their ids without touching itself. SPEC is a
JSON file of torchrun's parsed arguments; the trial's configuration is in the environment.
A session of its own also means no signal to the launcher reaches it: where the launcher ends
without stopping it (SIGKILL, the kernel's OOM killer), the kernel sends it SIGTERM
(``PR_SET_PDEATHSIG``, Linux), on which torch's agent stops its ranks.
When a rank fails, the first failure (its rank, local rank and exit code) is written as JSON to
``failure.json`` beside SPEC, so the launcher finds that rank's own output without reading the
log; with it the ranks of this node that had already exited with status 0 (``ended``), which
torch's agent leaves out of its failures: a script that ended early on one rank makes its
peers fail in their next collective, and that rank is the cause. Only where the agent records
the ranks it stops (:func:`records_stopped_ranks`) can the two be told apart.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import sys
from pathlib import Path

import torch.distributed.run as torchrun
from torch.distributed.elastic.multiprocessing.api import SubprocessContext
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from distune.launcher.options import local_world_size
from distune.launcher.trial_runner import FAILURE_FILE, failure_exit_code

#: prctl's option: the signal this process gets when its parent ends.
_PR_SET_PDEATHSIG = 1


def end_with_launcher(launcher: int) -> None:
    """Have the kernel send this process SIGTERM when the launcher (pid ``launcher``, its
    parent) ends, however it ends; at once where it has ended already. Linux only."""
    if not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != launcher:  # it ended before the request was in place
        os.kill(os.getpid(), signal.SIGTERM)


def records_stopped_ranks() -> bool:
    """Whether torch's agent counts the ranks it stops after a failure among the failures
    (newer torch polls them again once stopped: pytorch PR 160908). Older agents leave them
    out, like the ranks that exited with status 0, so the two cannot be told apart there."""
    return hasattr(SubprocessContext, "_capture_process_failures")


def ended_ranks(error: ChildFailedError, first_rank: int, local_ranks: int) -> list[int]:
    """This node's ranks that had exited with status 0 when the first failure came: those
    the agent's failures leave out, where it records the ranks it stopped (else none is
    named, rather than a stopped rank named wrongly)."""
    if not records_stopped_ranks():
        return []
    failed = {f.local_rank for f in error.failures.values()}
    return [first_rank + local for local in range(local_ranks) if local not in failed]


def main(argv: list[str]) -> int:
    """Run the ranks; the exit code is the first failed rank's (128 + N for signal N)."""
    if len(argv) > 1:
        end_with_launcher(int(argv[1]))
    args = argparse.Namespace(**json.loads(Path(argv[0]).read_text(encoding="utf-8")))
    try:
        torchrun.run(args)
    except ChildFailedError as error:
        print(error.format_msg(), file=sys.stderr, flush=True)
        rank, failure = error.get_first_failure()
        code = failure_exit_code(error)
        first = {
            "rank": rank,
            "local_rank": failure.local_rank,
            "exit_code": code,
            "ended": ended_ranks(error, rank - failure.local_rank, local_world_size(args)),
        }
        Path(argv[0]).with_name(FAILURE_FILE).write_text(json.dumps(first), encoding="utf-8")
        return code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
