"""One rank per node writes a level-2 trial's progress file, which that node's launcher
watches, however torch's agent numbers the node's local ranks."""

from __future__ import annotations

import pytest

from distune.worker_runtime.trial_measurement import writes_progress


def agent_env(node: int, local_rank: int, per_node: int, virtual: bool) -> dict[str, str]:
    """A worker's variables as torch's LocalElasticAgent sets them (``_start_workers``) on
    equal nodes: ``--virtual-local-rank`` sets LOCAL_RANK to 0 in every worker."""
    return {
        "RANK": str(node * per_node + local_rank),
        "GROUP_RANK": str(node),
        "LOCAL_WORLD_SIZE": str(per_node),
        "LOCAL_RANK": "0" if virtual else str(local_rank),
    }


@pytest.mark.parametrize("virtual", [False, True])
def test_each_node_has_one_progress_writer_its_first_rank(virtual: bool) -> None:
    writers = {}
    for node in range(2):
        for local_rank in range(3):
            env = agent_env(node, local_rank, 3, virtual)
            if writes_progress(int(env["RANK"]), env):
                writers.setdefault(node, []).append(int(env["RANK"]))
    assert writers == {0: [0], 1: [3]}


def test_without_a_launchers_variables_rank_0_writes() -> None:
    # mp.spawn, or a process group made by hand: one node.
    assert [rank for rank in range(4) if writes_progress(rank, {})] == [0]
