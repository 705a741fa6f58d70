"""A node lost in the middle of hierarchical allreduce: the surviving node's ranks fail, never hang.

Two simulated nodes of two gloo ranks each (``GROUP_RANK`` 0 and 1) train with hierarchical
allreduce pinned and small buckets, so each backward queues several bucket chains (reduce to the
node leader, allreduce among leaders, broadcast) in the CPU worker thread. Then node 1's ranks
exit at once, as when a machine dies. Node 0's leader (rank 0) sees the dead peer in the leaders'
allreduce and must exit with the error, so that torch's elastic agent stops the job; its peer on
node 0, waiting in that chain's broadcast, is the agent's to stop.

Found on two network namespaces joined by a veth pair (deploy/README.md, "Two machines by
hand"): with the queued chains left to run, the leader's next chain waited in a reduce for its
peer until the process group's timeout, and the interpreter joined that thread before the failed
rank could exit, so a job whose second node died hung for the timeout (30 minutes by default)
instead of failing.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
from ddp_launch import start_ranks  # forked from the zygotes shared with the other jobs

#: Seconds node 0's leader may take to fail once node 1 is gone (it takes about one here);
#: the ranks' process-group timeout is far beyond it, so only a failure that does not wait for
#: a timeout passes.
FAIL_WITHIN = 20.0
PROCESS_GROUP_TIMEOUT = timedelta(seconds=300)
LOST_AT_STEP = 3


@pytest.mark.slow
def test_the_surviving_leader_fails_at_once_when_a_node_dies_mid_hierarchical_allreduce(tmp_path):
    ranks = start_ranks([__file__, str(tmp_path)], tmp_path, nodes=2, per_node=2)
    try:
        lost = tmp_path / "lost"
        deadline = time.monotonic() + 120  # start-up on a loaded machine
        while not lost.exists() and time.monotonic() < deadline:
            assert ranks[0].poll() is None, (tmp_path / "rank0.err").read_text()
            time.sleep(0.05)
        assert lost.exists(), "node 1 never reached its last step"
        deadline = time.monotonic() + FAIL_WITHIN
        while ranks[0].poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        errors = (tmp_path / "rank0.err").read_text()
        assert ranks[0].poll() not in (None, 0), f"rank 0 still waits after node 1 died:\n{errors}"
        assert "RuntimeError" in errors, errors  # gloo's: the peer closed the connection
    finally:
        for rank in ranks:
            rank.kill()
            rank.wait()


def _train_until_node_1_is_lost(out_dir: Path) -> None:
    import torch
    import torch.distributed as dist

    import distune

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://", timeout=PROCESS_GROUP_TIMEOUT)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(128, 128) for _ in range(6)))
    # 64 KiB buckets: each backward queues a chain per pair of layers.
    ddp = distune.DistributedDataParallel(model, bucket_size=2**16, hierarchical=True)
    for step in range(10_000):
        if step == LOST_AT_STEP and os.environ["GROUP_RANK"] == "1":
            (out_dir / "lost").touch()
            os._exit(1)  # the machine is gone: no exception, no goodbye
        ddp(torch.randn(4, 128)).sum().backward()


if __name__ == "__main__":
    _train_until_node_1_is_lost(Path(sys.argv[1]))
