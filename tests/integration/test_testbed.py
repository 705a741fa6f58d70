"""The shaped testbed: it comes up, carries a gloo job across namespaces, and always tears down."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# `benchmarks` is a top-level folder of the repository, not part of the installed package.
sys.path.insert(0, str(REPO))

from benchmarks.testbed import (  # noqa: E402
    ETC_NETNS,
    LinkRate,
    Node,
    Testbed,
    TestbedError,
    launcher_argv,
    missing_prerequisites,
    remove_stale_testbeds,
    require_prerequisites,
    run_on_nodes,
)
from benchmarks.testbed.iproute import IpRoute  # noqa: E402
from benchmarks.testbed.lower_bound import busiest_link_bytes, step_lower_bound  # noqa: E402

#: Tests that build testbeds need root and iproute2 (they are also slow: they start processes).
needs_testbed = pytest.mark.skipif(
    bool(missing_prerequisites()), reason="; ".join(missing_prerequisites())
)

GLOO_JOB = textwrap.dedent(
    """
    import os, sys, time
    from datetime import timedelta
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    print(f"pid {os.getpid()}", flush=True)
    if sys.argv[1] == "fail":
        if rank == 1:
            sys.exit(3)
        time.sleep(120)  # a peer stuck waiting for the failed node
    tensor = torch.full((1 << 18,), float(rank + 1))  # 1 MiB
    for _ in range(5):
        result = tensor.clone()
        dist.all_reduce(result)
        assert torch.all(result == 3.0), result
    print("allreduce ok", flush=True)
    dist.destroy_process_group()
    os._exit(0)  # not through finalization: see examples/job.py's leave()
    """
)


def namespaces_of(prefix: str) -> list[str]:
    """Namespaces, and their /etc/netns folders, whose names start with ``prefix``."""
    names = [*require_prerequisites().namespaces(), *(p.name for p in ETC_NETNS.glob("*"))]
    return sorted({name for name in names if name.startswith(prefix)})


def pids_in(output: str) -> list[int]:
    return [int(line.split()[1]) for line in output.splitlines() if line.startswith("pid ")]


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_for(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.slow
@needs_testbed
@pytest.mark.timeout(60)
def test_two_shaped_nodes_run_a_gloo_job_over_their_link_and_vanish(tmp_path):
    script = tmp_path / "gloo_job.py"
    script.write_text(GLOO_JOB)
    with Testbed(nodes=2, rate="1gbit") as bed:
        name = bed.name
        node0, node1 = bed.nodes
        assert (node0.address, node1.address) == ("10.77.0.1", "10.77.0.2")
        assert sorted(bed.namespaces()) == [f"{name}-node0", f"{name}-node1"]
        hosts = node1.run(["cat", "/etc/hosts"], capture_output=True, text=True, check=True)
        assert "10.77.0.1 node0" in hosts.stdout
        # Both directions are shaped: each end of the pair limits what it transmits.
        assert {(d.namespace, d.device) for d in bed.shaped_devices} == {
            (node0.namespace, "veth0"),
            (node1.namespace, "veth1"),
        }
        for device in bed.shaped_devices:
            (qdisc,) = node0.iproute.qdiscs(device.namespace, device.device)
            assert qdisc["kind"] == "tbf" and qdisc["root"]
            assert qdisc["options"]["rate"] == 125_000_000  # bytes/s
        for node in bed.nodes:
            assert node.iproute.link(node.namespace, node.interface)["mtu"] == 9000
            assert "UP" in node.iproute.link(node.namespace, "lo")["flags"]
        before = [node.link_counters() for node in bed.nodes]

        results = run_on_nodes(
            bed.nodes,
            lambda node: [sys.executable, str(script), "ok"],
            output_dir=tmp_path / "out",
            timeout=45,
        )
        outputs = [result.read_output() for result in results]
        assert [result.ok for result in results] == [True, True], outputs
        assert all("allreduce ok" in output for output in outputs)
        assert (tmp_path / "out" / "results.json").exists()
        # The allreduces went through the veth link, in both directions.
        after = [node.link_counters() for node in bed.nodes]
        for old, new in zip(before, after, strict=True):
            assert new.tx_bytes - old.tx_bytes > 2 * (1 << 20)
            assert new.rx_bytes - old.rx_bytes > 2 * (1 << 20)

    assert namespaces_of(name) == []
    with pytest.raises(TestbedError, match="not up"):
        bed.nodes  # noqa: B018
    assert not any(alive(pid) for output in outputs for pid in pids_in(output))


@pytest.mark.slow
@needs_testbed
@pytest.mark.timeout(60)
def test_a_failing_node_stops_its_stuck_peer_and_an_error_still_tears_down(tmp_path):
    script = tmp_path / "gloo_job.py"
    script.write_text(GLOO_JOB)
    with pytest.raises(RuntimeError, match="after the job"), Testbed(nodes=2) as bed:
        name = bed.name
        results = run_on_nodes(
            bed.nodes,
            lambda node: [sys.executable, str(script), "fail"],
            output_dir=tmp_path,
            timeout=45,
            failure_grace=1.0,
        )
        stuck, failed = results
        assert (failed.returncode, failed.stopped) == (3, None)
        assert (stuck.returncode, stuck.stopped) == (-signal.SIGTERM, "peer failed")
        assert not stuck.ok and not failed.ok
        pids = pids_in(stuck.read_output()) + pids_in(failed.read_output())
        assert len(pids) == 2
        raise RuntimeError("after the job")
    assert namespaces_of(name) == []
    assert not any(alive(pid) for pid in pids)


@pytest.mark.slow
@needs_testbed
@pytest.mark.timeout(30)
def test_a_bridged_testbed_shapes_every_port_and_stops_jobs_at_their_timeout(tmp_path):
    with Testbed(nodes=3, rate="100mbit") as bed:
        assert bed.switch_namespace in bed.namespaces()
        # Each node's own end and its bridge port: both directions of every node's link.
        assert len(bed.shaped_devices) == 6
        for device in bed.shaped_devices:
            (qdisc,) = bed.nodes[0].iproute.qdiscs(device.namespace, device.device)
            assert (qdisc["kind"], qdisc["options"]["rate"]) == ("tbf", 12_500_000)
        # Node 2 reaches node 0 through the bridge: a closed port answers at once (refused).
        probe = "import socket; socket.create_connection(('10.77.0.1', 9), timeout=5)"
        done = bed.nodes[2].run([sys.executable, "-c", probe], capture_output=True, text=True)
        assert "ConnectionRefusedError" in done.stderr

        results = run_on_nodes(
            bed.nodes, lambda node: ["sleep", "30"], output_dir=tmp_path, timeout=0.5
        )
        assert [(r.returncode, r.stopped) for r in results] == [(-signal.SIGTERM, "timeout")] * 3
        name = bed.name
    assert namespaces_of(name) == []


@pytest.mark.slow
@needs_testbed
@pytest.mark.timeout(60)
def test_sigterm_to_the_command_tears_down_a_bridged_testbed_and_stale_ones_are_removed(tmp_path):
    def start(seconds: int) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "benchmarks.testbed", "exec", "--nodes", "3",
             "--rate", "100mbit", "--output", str(tmp_path), "--", "sleep", str(seconds)],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip

    # Interrupted: the command tears its testbed down and exits 128 + 15.
    command = start(60)
    prefix = f"distune-tb-{command.pid}-"
    # 3 nodes and the switch, and the nodes' /etc/netns folders (same names)
    assert wait_for(lambda: len(namespaces_of(prefix)) == 4, 20)
    assert wait_for(lambda: (tmp_path / "node2.log").exists(), 10)
    command.send_signal(signal.SIGTERM)
    output, _ = command.communicate(timeout=20)
    assert command.returncode == 128 + signal.SIGTERM, output
    assert "interrupted by signal 15" in output
    assert namespaces_of(prefix) == []

    # Killed outright: its testbed is left behind, stale, until the next one removes it.
    command = start(60)
    prefix = f"distune-tb-{command.pid}-"
    assert wait_for(lambda: len(namespaces_of(prefix)) == 4, 20)
    iproute = require_prerequisites()

    def sleeping() -> list[int]:
        return [pid for ns in namespaces_of(prefix) for pid in iproute.namespace_pids(ns)]

    assert wait_for(lambda: len(sleeping()) == 3, 10)
    orphans = sleeping()
    command.kill()
    command.communicate(timeout=10)
    assert len(namespaces_of(prefix)) == 4
    with Testbed(nodes=2) as live:
        # Coming up removed the dead command's testbed; one whose owner lives is never stale.
        assert namespaces_of(prefix) == []
        assert remove_stale_testbeds(iproute) == []
        assert len(live.namespaces()) == 2
    assert wait_for(lambda: not any(alive(pid) for pid in orphans), 5)


@pytest.mark.slow
@needs_testbed  # as root, so that it can drop root
def test_without_root_the_command_says_so_and_fails():
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("setpriv (util-linux) is needed to drop root")
    nobody = ["--reuid=65534", "--regid=65534", "--clear-groups"]
    done = subprocess.run(
        [setpriv, *nobody, sys.executable, "-m", "benchmarks.testbed", "run", "--", "train.py"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
        env={**os.environ, "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert done.returncode == 3
    assert "needs root" in done.stderr and "sudo" in done.stderr


# --- the parts that need no testbed -----------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "bits"),
    [("1gbit", 10**9), ("2.5Gbit", 25 * 10**8), ("500mbit", 5 * 10**8), ("100000bit", 10**5)],
)
def test_rates_read_as_tc_writes_them(text, bits):
    rate = LinkRate.parse(text)
    assert rate.bits_per_second == bits
    assert LinkRate.parse(str(rate)) == rate


@pytest.mark.parametrize("text", ["2gbps", "fast", "", "-1gbit", "1 gigabit"])
def test_a_bad_rate_names_the_units_allowed(text):
    with pytest.raises(ValueError, match="kbit, mbit, gbit"):
        LinkRate.parse(text)


def test_payload_rate_leaves_out_frame_headers():
    # 9000-byte IP packets carry 8948 payload bytes in 9014-byte frames.
    assert LinkRate.parse("1gbit").payload_bytes_per_second(9000) == pytest.approx(
        125e6 * 8948 / 9014
    )


@pytest.mark.parametrize(
    ("nodes", "per_node", "shape", "share"),
    [
        (2, 1, "flat", 1.0),  # 2 (n-1)/n, n = 2
        (2, 2, "flat", 1.5),  # n = 4: the ring edge between the nodes carries 2 * 3/4
        (2, 2, "hierarchical", 1.0),  # only the 2 leaders' ring crosses
        (4, 8, "flat", 2 * 31 / 32),
        (4, 8, "hierarchical", 1.5),
        (1, 8, "flat", 0.0),  # one node: nothing crosses a link
    ],
)
def test_busiest_link_bytes_follow_the_ring(nodes, per_node, shape, share):
    assert busiest_link_bytes(1000.0, nodes, per_node, shape) == pytest.approx(1000.0 * share)


def test_the_step_bound_is_the_larger_of_compute_and_link_time():
    rate = LinkRate.parse("1gbit")
    link = 2e6 / rate.payload_bytes_per_second(9000)
    slow_link = step_lower_bound(
        compute_seconds=link / 2, gradient_bytes=2e6, nodes=2, ranks_per_node=2, rate=rate
    )
    assert (slow_link.seconds, slow_link.bound_by) == (pytest.approx(link), "link")
    fast_link = step_lower_bound(
        compute_seconds=1.0, gradient_bytes=2e6, nodes=2, ranks_per_node=2, rate=rate, shape="flat"
    )
    assert (fast_link.seconds, fast_link.bound_by) == (1.0, "compute")
    with pytest.raises(ValueError, match="flat, hierarchical"):
        busiest_link_bytes(1.0, 2, 2, "tree")


def test_launcher_command_carries_the_rendezvous_and_refuses_to_repeat_it():
    node = Node(1, 2, "ns", "veth1", "10.77.0.2", "10.77.0.1", IpRoute(ip="ip", tc="tc"))
    argv = launcher_argv(node, 2, ["--autotune_level", "1", "train.py", "--nnodes", "7"])
    assert argv[1:3] == ["-m", "distune.run"]
    assert argv[argv.index("--node_rank") + 1] == "1"
    assert argv[argv.index("--master_addr") + 1] == "10.77.0.1"
    assert argv[-5:] == ["--autotune_level", "1", "train.py", "--nnodes", "7"]  # the script's own
    for repeated in (["--nnodes", "3"], ["--master-addr=x"], ["--rdzv_backend", "c10d"]):
        with pytest.raises(ValueError, match="the testbed sets"):
            launcher_argv(node, 2, [*repeated, "train.py"])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"nodes": 1}, "2 to 64 nodes"),
        ({"nodes": 2, "burst_bytes": 9000}, "must exceed the largest frame"),
        ({"nodes": 2, "rate": "fast"}, "bad link rate"),
        ({"nodes": 5, "subnet": "10.0.0.0/30"}, "5 host addresses"),
    ],
)
def test_a_bad_testbed_configuration_is_refused_before_anything_is_built(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Testbed(**kwargs)


def test_node0s_result_line_is_read_once_every_node_ended_ok(tmp_path):
    from benchmarks.testbed.node_jobs import NodeResult, node0_result

    logs = []
    for rank, text in enumerate(['noise\nRESULT {"seconds": 0.5}\n', "RESULT {}\n"]):
        logs.append(tmp_path / f"node{rank}.log")
        logs[-1].write_text(text)
    ended = [NodeResult(rank, ("job",), 0, 1.0, log) for rank, log in enumerate(logs)]
    assert node0_result(ended, "RESULT ") == {"seconds": 0.5}
    stopped = [ended[0], NodeResult(1, ("job",), -15, 1.0, logs[1], stopped="peer failed")]
    with pytest.raises(RuntimeError, match=r"bandwidth: node1 failed, see .*node1\.log"):
        node0_result(stopped, "RESULT ", "bandwidth")
