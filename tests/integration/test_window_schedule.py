"""The worker's window schedule in a real two-rank gloo job: after a switch to a much slower
group the window lasts one iteration, the next one is sized from it, and both ranks keep every
sync point and every switch at the same iteration.

The leader's client is scripted (it answers like the service, without HTTP): what is under test
is the schedule and the lockstep, not the conversation (tests/unit/worker_runtime has that).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from ddp_launch import run_job, worker_main

from distune import Hyperparameters
from distune.worker_runtime.leader_client import ServiceAnswer, WindowReport
from distune.worker_runtime.sync import SWITCH_WINDOW, SyncPoints

pytestmark = pytest.mark.slow
FAST, SLOW = Hyperparameters(20, False), Hyperparameters(16, False)
#: Each rank's step time under each group (rank 1 is the slower rank, whose time counts).
STEP = {FAST: (0.001, 0.0015), SLOW: (0.020, 0.025)}
SYNC_INTERVAL = 0.05
#: Reports of the fast group before the scripted service switches to the slow one.
FAST_REPORTS = 6
#: Reports of the slow group before it completes on it.
SLOW_REPORTS = 3


class ScriptedService:
    """Rank 0's client, answering as the service would: the fast group, then the slow one,
    then completed. Its answer changes when a report arrives, so, as with the real client, the
    leader acts on it at the next sync point."""

    refused = False

    def __init__(self) -> None:
        self.reports: list[WindowReport] = []
        self._answer = ServiceAnswer(1, FAST, "sampling", False)

    def latest(self) -> ServiceAnswer:
        return self._answer

    def report(self, report: WindowReport) -> None:
        self.reports.append(report)
        slow = sum(r.group_id == 2 for r in self.reports)
        if len(self.reports) == FAST_REPORTS:
            self._answer = ServiceAnswer(2, SLOW, "sampling", False)
        elif slow >= SLOW_REPORTS:
            self._answer = ServiceAnswer(2, SLOW, "completed", True)

    def close(self) -> None:
        pass


def switch_to_a_slow_group(out_dir: Path) -> dict[str, Any]:
    rank = dist.get_rank()
    client = ScriptedService() if rank == 0 else None
    sync = SyncPoints(dist.group.WORLD, torch.device("cpu"), client, FAST, SYNC_INTERVAL)
    hp, steps = FAST, []
    for iteration in range(1, 2000):
        time.sleep(STEP[hp][rank])
        switch = sync.after_iteration(iteration)
        hp = switch or hp
        steps.append([iteration, hp.bucket_size_2p, sync._next_at, sync.stopped])
        if sync.stopped:
            break
    reports = [] if client is None else [vars(r) for r in client.reports]
    return {"steps": steps, "reports": reports}


def test_a_slow_group_costs_one_iteration_before_its_first_report_in_lockstep(tmp_path):
    results = run_job(__file__, "switch_to_a_slow_group", tmp_path)
    leader, other = results
    assert leader["steps"] == other["steps"]  # every switch and sync point at the same iteration
    assert leader["steps"][-1][3], "tuning completed"
    reports = leader["reports"]
    fast = [r for r in reports if r["group_id"] == 1]
    slow = [r for r in reports if r["group_id"] == 2]
    assert len(slow) == SLOW_REPORTS + 1  # the window closed where completion is applied
    # The window after the switch: one iteration, whatever the fast windows before it were.
    assert slow[0]["iterations"] == SWITCH_WINDOW
    # The next is sized from that iteration's time (>= 20 ms): about SYNC_INTERVAL's worth.
    assert slow[1]["iterations"] <= round(SYNC_INTERVAL / STEP[SLOW][0])
    assert max(r["iterations"] for r in fast) > slow[1]["iterations"]
    switched_at = next(i for i, bucket, _, _ in leader["steps"] if bucket == SLOW.bucket_size_2p)
    assert slow[0]["train_iter"] == switched_at + SWITCH_WINDOW


if __name__ == "__main__":
    worker_main({"switch_to_a_slow_group": switch_to_a_slow_group})
