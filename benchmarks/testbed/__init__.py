"""A shaped multi-node testbed on one machine: network namespaces joined over tbf-limited veth.

Command line: ``python -m benchmarks.testbed --help``. Python::

    from benchmarks.testbed import Testbed, run_distune

    with Testbed(nodes=2, rate="2gbit") as bed:
        results = run_distune(bed, ["--autotune_level", "1", "examples/train_mlp.py"],
                              nproc_per_node=2, output_dir=Path("out"), timeout=300)
"""

from benchmarks.testbed.distune_job import DISTUNE_RUN, TORCHRUN, launcher_argv, run_distune
from benchmarks.testbed.errors import TestbedError, TestbedInterrupted, TestbedUnavailable
from benchmarks.testbed.network import (
    ETC_NETNS,
    MASTER_PORT,
    LinkCounters,
    Node,
    ShapedDevice,
    Testbed,
    remove_stale_testbeds,
    stale_testbeds,
)
from benchmarks.testbed.node_jobs import NodeResult, run_on_nodes
from benchmarks.testbed.prerequisites import missing_prerequisites, require_prerequisites
from benchmarks.testbed.rate import LinkRate

__all__ = [
    "DISTUNE_RUN",
    "ETC_NETNS",
    "MASTER_PORT",
    "TORCHRUN",
    "LinkCounters",
    "LinkRate",
    "Node",
    "NodeResult",
    "ShapedDevice",
    "Testbed",
    "TestbedError",
    "TestbedInterrupted",
    "TestbedUnavailable",
    "launcher_argv",
    "missing_prerequisites",
    "remove_stale_testbeds",
    "require_prerequisites",
    "run_distune",
    "run_on_nodes",
    "stale_testbeds",
]
