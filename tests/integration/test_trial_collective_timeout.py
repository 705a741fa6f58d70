"""A level-2 trial's ranks do not wait for a silent peer past their collective time-out
(``DISTUNE_TRIAL_COLLECTIVE_TIMEOUT``, set by ``distune.prepare`` on the process group): the
backstop that ends a rank even when no launcher is left to stop it.

This file is also the worker script (see ddp_launch).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
from ddp_launch import run_job, worker_main
from torch import nn

import distune
from distune.trial_settings import COLLECTIVE_TIMEOUT, TRIAL_DIR

pytestmark = pytest.mark.slow
TIMEOUT_SECONDS = 3
SILENCE_SECONDS = 12


def silent_peer(out: Path) -> dict:
    os.environ.update({TRIAL_DIR: str(out), COLLECTIVE_TIMEOUT: str(TIMEOUT_SECONDS)})
    model = nn.Linear(4, 4)
    distune.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batch_size=2)
    if torch.distributed.get_rank() == 1:
        # Alive, but never joins the collective: silent until rank 0 has given up and left (its
        # result written), at most SILENCE_SECONDS, so that a rank 0 still waiting fails below.
        deadline = time.monotonic() + SILENCE_SECONDS
        while not (out / "rank0.json").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return {"waited": None, "error": None}
    start = time.monotonic()
    try:
        torch.distributed.all_reduce(torch.ones(4))
    except RuntimeError as error:
        return {"waited": time.monotonic() - start, "error": str(error)}
    return {"waited": time.monotonic() - start, "error": None}


def test_a_collective_waiting_for_a_silent_peer_fails_after_the_trials_timeout(tmp_path):
    rank0, _ = run_job(__file__, "silent_peer", tmp_path, timeout=120)
    assert rank0["error"] is not None, rank0
    assert "timed out" in rank0["error"].lower() or "timeout" in rank0["error"].lower()
    # torch's default would be 30 minutes; the peer stays silent for 12 s unless rank 0 left.
    assert TIMEOUT_SECONDS - 0.5 <= rank0["waited"] < SILENCE_SECONDS - 1


if __name__ == "__main__":
    worker_main({"silent_peer": silent_peer})
