"""``distune-run`` (or plain torchrun, as a baseline) on every node of a testbed.

Every node runs the launcher with static rendezvous at node 0, so the launchers form one
multi-node job over the shaped links.
"""

from __future__ import annotations

import os
import secrets
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from benchmarks.testbed.network import MASTER_PORT, Node, Testbed
from benchmarks.testbed.node_jobs import NodeResult, run_on_nodes

#: The launchers, as ``python -m`` modules.
DISTUNE_RUN = "distune.run"
TORCHRUN = "torch.distributed.run"
#: Flags the testbed sets for every node; the job's own arguments may not repeat them.
_TESTBED_FLAGS = (
    "nnodes",
    "node_rank",
    "master_addr",
    "master_port",
    "rdzv_backend",
    "rdzv_endpoint",
    "standalone",
)
_TOKEN = "DISTUNE_SERVICE_TOKEN"


def launcher_argv(
    node: Node, nproc_per_node: int, args: Sequence[str], *, launcher: str = DISTUNE_RUN
) -> list[str]:
    """``node``'s launcher command line: the testbed's rendezvous flags, then ``args``.

    ``args`` are the launcher's other flags, then the training script and its arguments.
    """
    if nproc_per_node < 1:
        raise ValueError(f"nproc_per_node must be at least 1, got {nproc_per_node}")
    for arg in args:
        if arg.endswith(".py") or arg in ("-m", "--module"):
            break  # the training script: what follows is its own
        flag = arg.split("=", 1)[0].lstrip("-").replace("-", "_")
        if arg.startswith("--") and flag in _TESTBED_FLAGS:
            raise ValueError(f"the testbed sets {arg.split('=', 1)[0]} itself: leave it out")
    return [
        sys.executable, "-m", launcher,
        "--nnodes", str(node.nnodes), "--node_rank", str(node.rank),
        "--nproc_per_node", str(nproc_per_node),
        "--rdzv_backend", "static",
        "--master_addr", node.master_address, "--master_port", str(MASTER_PORT),
        *args,
    ]  # fmt: skip


def run_distune(
    bed: Testbed,
    args: Sequence[str],
    *,
    nproc_per_node: int,
    output_dir: Path,
    timeout: float,
    env: Mapping[str, str] | None = None,
    echo: bool = False,
    launcher: str = DISTUNE_RUN,
) -> list[NodeResult]:
    """Run ``distune-run <testbed flags> ARGS`` on every node of ``bed``; one result per node.

    ``launcher=TORCHRUN`` runs plain torchrun instead (a baseline). Multi-node tuning needs the
    same ``DISTUNE_SERVICE_TOKEN`` on every node: the one in ``env`` or this process's
    environment, else a fresh random one for this job.
    """
    environment = dict(env or {})
    environment.setdefault(_TOKEN, os.environ.get(_TOKEN) or secrets.token_urlsafe(24))
    return run_on_nodes(
        bed.nodes,
        lambda node: launcher_argv(node, nproc_per_node, args, launcher=launcher),
        output_dir=output_dir,
        timeout=timeout,
        env=environment,
        echo=echo,
    )
