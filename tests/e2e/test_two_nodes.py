"""Two distune-run launchers on one machine form one two-node job: one service, one tuning."""

from __future__ import annotations

import csv

import pytest

from tests.support.launcher_process import FAST_TUNING
from tests.support.local_host import free_port_pair, port_is_free

from .conftest import SMALL_MLP

pytestmark = pytest.mark.slow

#: Long enough for three samples, one of them a close call (legs of FAST_TUNING's 2 sampling
#: times): tuning completes about 6 s after the first step here (under load), so 20 s leave it
#: 3x that.
JOB_SECONDS = "20"


def test_two_nodes_share_one_service_and_tune_with_a_fixed_bucket(launch, tmp_path):
    port = free_port_pair()
    log = tmp_path / "two_nodes.log"
    config = tmp_path / "fixed_bucket.yaml"
    config.write_text("bucket_size: 262144\n")  # only the allreduce shape is tuned
    common = [
        "--nnodes", "2", "--nproc_per_node", "2", "--rdzv_backend", "static",
        "--master_addr", "127.0.0.1", "--master_port", str(port),
        "--autotune_level", "1", "--autotune_config", str(config), *FAST_TUNING,
        "--autotune_max_samples", "3",  # the default, hierarchical, one close call
    ]  # fmt: skip
    env = {"DISTUNE_SERVICE_TOKEN": "two-node-secret"}
    node0 = launch(
        [
            *common,
            "--node_rank",
            "0",
            "--autotune_log_file",
            str(log),
            *SMALL_MLP,
            "--seconds",
            JOB_SECONDS,
        ],
        env,
    )
    node1 = launch([*common, "--node_rank", "1", *SMALL_MLP, "--seconds", JOB_SECONDS], env)
    assert node0.service_url() == f"http://127.0.0.1:{port + 1}"
    assert node0.wait(timeout=180) == 0, node0.output
    assert node1.wait(timeout=60) == 0, node1.output
    assert "tuning service at" not in node1.output

    with log.open() as handle:
        rows = list(csv.DictReader(handle))
    assert rows, "no sample was logged"
    assert {row["bucket_size_2p"] for row in rows} == {"18"}
    assert {row["is_hierarchical_reduce"] for row in rows} == {"False", "True"}
    assert "model mlp: completed" in node0.output
    assert node0.leftovers() == [] and node1.leftovers() == []
    assert port_is_free(port + 1)
