"""The testbed: K "nodes" as network namespaces on this machine, joined over shaped veth links.

Topology. Two nodes are joined by one veth pair; more nodes each get a veth pair to a Linux
bridge that lives in its own "switch" namespace, so nothing of the testbed appears in the host's
namespace and deleting the namespaces deletes every link. Each node has one address on one
subnet, loopback up, and IPv6 off on its link (gloo must not pick a link-local address).

Shaping. Every link end that transmits between nodes has a ``tbf`` root qdisc: both ends of the
pair, or the node's end and its bridge port. So a node's traffic is limited to the rate in each
direction, like a NIC of that speed on a non-blocking switch. The burst must exceed the largest
frame (MTU plus the Ethernet header) or tbf drops every full-size frame.

Name resolution. Each node's ``/etc/hosts`` (through ``/etc/netns/<namespace>/hosts``, which
``ip netns exec`` mounts) names the nodes ``node0``, ``node1``, ..., so reverse lookups of node
addresses answer at once instead of waiting on a DNS server the namespace cannot reach, and
the machine's host name resolves to the node's own address, as it would on a real node.

Names. An instance is ``distune-tb-<owner pid>-<random>``; its namespaces add ``-node<i>`` or
``-switch``. Two testbeds never collide, and one whose owner process is gone is stale: the next
testbed (or ``python -m benchmarks.testbed cleanup``) kills its processes and deletes it.
Instances of living owners are never touched.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

from benchmarks.testbed.errors import TestbedError, TestbedInterrupted
from benchmarks.testbed.iproute import IpRoute
from benchmarks.testbed.prerequisites import require_prerequisites
from benchmarks.testbed.rate import ETHERNET_HEADER_BYTES, LinkRate
from tests.support.local_host import is_running

logger = logging.getLogger(__name__)

PREFIX = "distune-tb"
_NAMESPACE = re.compile(
    rf"^(?P<instance>{PREFIX}-(?P<owner>\d+)-[0-9a-f]{{6}})-(?:node\d+|switch)$"
)
#: Per-namespace files that ``ip netns exec`` bind-mounts over /etc.
ETC_NETNS = Path("/etc/netns")
#: The rendezvous port on node 0: every node has its own port space, so it is always free.
MASTER_PORT = 29500
DEFAULT_SUBNET = "10.77.0.0/24"
DEFAULT_MTU = 9000
DEFAULT_BURST_BYTES = 256 * 1024
DEFAULT_LATENCY_MS = 200
MAX_NODES = 64
#: How long processes get to exit on SIGTERM before SIGKILL, and links to come up.
_GRACE_SECONDS = 3.0
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
_ALL_SIGNALS = (signal.SIGINT, *_STOP_SIGNALS)


@dataclass(frozen=True)
class LinkCounters:
    """Bytes a node's link has received and transmitted (the kernel's counters)."""

    rx_bytes: int
    tx_bytes: int


@dataclass(frozen=True)
class Node:
    """One node of a testbed: a network namespace with one address on the shaped network."""

    rank: int
    nnodes: int
    namespace: str
    interface: str
    address: str
    master_address: str
    iproute: IpRoute = field(repr=False)

    def environment(self) -> dict[str, str]:
        """Variables every process on this node gets.

        The socket interface variables make gloo (and NCCL, tensorpipe) use the node's link.
        ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE`` describe one process per node,
        so ``init_process_group("gloo")`` works as is; a launcher such as ``distune-run`` sets
        its own for its workers. ``NODE_RANK`` and ``NNODES`` name the node's place.
        """
        return {
            "GLOO_SOCKET_IFNAME": self.interface,
            "TP_SOCKET_IFNAME": self.interface,
            "NCCL_SOCKET_IFNAME": self.interface,
            "MASTER_ADDR": self.master_address,
            "MASTER_PORT": str(MASTER_PORT),
            "NODE_RANK": str(self.rank),
            "NNODES": str(self.nnodes),
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.nnodes),
        }

    def argv(self, command: Sequence[str]) -> list[str]:
        """The argv that runs ``command`` on this node."""
        return self.iproute.exec_argv(self.namespace, command)

    def popen(
        self, command: Sequence[str], *, env: Mapping[str, str] | None = None, **kwargs: Any
    ) -> subprocess.Popen:
        """Start ``command`` on this node with this process's environment, the node's and ``env``.

        Other keyword arguments go to :class:`subprocess.Popen`.
        """
        environment = {**os.environ, **self.environment(), **(env or {})}
        return subprocess.Popen(self.argv(command), env=environment, **kwargs)

    def run(
        self, command: Sequence[str], *, env: Mapping[str, str] | None = None, **kwargs: Any
    ) -> subprocess.CompletedProcess:
        """Run ``command`` on this node to completion, like :func:`subprocess.run`."""
        environment = {**os.environ, **self.environment(), **(env or {})}
        return subprocess.run(self.argv(command), env=environment, **kwargs)

    def link_counters(self) -> LinkCounters:
        """The node's link counters, e.g. to check that traffic took the shaped link."""
        stats = self.iproute.link(self.namespace, self.interface)["stats64"]
        return LinkCounters(rx_bytes=stats["rx"]["bytes"], tx_bytes=stats["tx"]["bytes"])


@dataclass(frozen=True)
class ShapedDevice:
    """A link end with a rate limit on what it transmits."""

    namespace: str
    device: str


class Testbed:
    """K nodes on shaped links, as a context manager that tears everything down on exit.

    ::

        with Testbed(nodes=2, rate="2gbit") as bed:
            bed.nodes[1].run(["python", "-c", "print('hello from node 1')"], check=True)

    ``rate`` None leaves the links unshaped (the machine's own ceiling). Entering removes stale
    testbeds first; while the testbed is up, SIGTERM and SIGHUP raise
    :class:`TestbedInterrupted` (a ``KeyboardInterrupt``) in the main thread, where their
    handlers were the default, so teardown runs as it does on Ctrl-C. Teardown kills every
    process left in the namespaces and deletes them, whatever ended the block.
    """

    __test__ = False  # a name pytest would otherwise try to collect

    def __init__(
        self,
        nodes: int,
        rate: LinkRate | str | None = None,
        *,
        mtu: int = DEFAULT_MTU,
        burst_bytes: int = DEFAULT_BURST_BYTES,
        latency_ms: int = DEFAULT_LATENCY_MS,
        subnet: str = DEFAULT_SUBNET,
    ) -> None:
        if not 2 <= nodes <= MAX_NODES:
            raise ValueError(f"a testbed has 2 to {MAX_NODES} nodes, got {nodes}")
        if not 576 <= mtu <= 65535:
            raise ValueError(f"mtu must be 576 to 65535 bytes, got {mtu}")
        if burst_bytes <= mtu + ETHERNET_HEADER_BYTES:
            raise ValueError(
                f"burst_bytes must exceed the largest frame, mtu + {ETHERNET_HEADER_BYTES} = "
                f"{mtu + ETHERNET_HEADER_BYTES} bytes, got {burst_bytes} (tbf drops bigger frames)"
            )
        if latency_ms <= 0:
            raise ValueError(f"latency_ms must be positive, got {latency_ms}")
        network = ipaddress.ip_network(subnet)
        if network.version != 4 or network.num_addresses - 2 < nodes:
            raise ValueError(
                f"subnet must be an IPv4 network with {nodes} host addresses: {subnet}"
            )
        self.nnodes = nodes
        self.rate = LinkRate.parse(rate) if isinstance(rate, str) else rate
        self.mtu = mtu
        self.burst_bytes = burst_bytes
        self.latency_ms = latency_ms
        self.network = network
        self.name = f"{PREFIX}-{os.getpid()}-{secrets.token_hex(3)}"
        self._iproute: IpRoute | None = None
        self._nodes: tuple[Node, ...] = ()
        self._shaped: tuple[ShapedDevice, ...] = ()
        self._saved_handlers: dict[int, Any] = {}

    @property
    def nodes(self) -> tuple[Node, ...]:
        """The nodes, node 0 first (the rendezvous host)."""
        if not self._nodes:
            raise TestbedError(f"testbed {self.name} is not up: use it in a `with` block")
        return self._nodes

    @property
    def switch_namespace(self) -> str | None:
        """The namespace holding the bridge, where there is one (more than two nodes)."""
        return f"{self.name}-switch" if self.nnodes > 2 else None

    @property
    def shaped_devices(self) -> tuple[ShapedDevice, ...]:
        """Every link end that has a rate limit (empty when unshaped)."""
        return self._shaped

    def namespaces(self) -> list[str]:
        """This testbed's namespaces that exist right now."""
        iproute = self._iproute or IpRoute.locate()
        return [name for name in iproute.namespaces() if name.startswith(f"{self.name}-")]

    def leftovers(self) -> list[str]:
        """This testbed's namespaces and ``/etc/netns`` folders that exist right now."""
        etc = [path.name for path in ETC_NETNS.glob(f"{self.name}-*")]
        return sorted({*self.namespaces(), *etc})

    def describe(self) -> str:
        """One line: nodes, addresses, rate."""
        rate = f"links shaped to {self.rate}" if self.rate else "links unshaped"
        shape = "veth pair" if self.nnodes == 2 else "bridge"
        addresses = ", ".join(f"node{n.rank} {n.address} ({n.interface})" for n in self.nodes)
        return f"testbed {self.name}: {addresses}; {shape}, MTU {self.mtu}, {rate}"

    def __enter__(self) -> Testbed:
        if self._iproute is not None:
            raise TestbedError(f"testbed {self.name} is already up")
        iproute = require_prerequisites()
        remove_stale_testbeds(iproute)
        self._iproute = iproute
        self._catch_stop_signals()
        try:
            self._build(iproute)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        try:
            self.close()
        except TestbedError:
            if error is None:
                raise
            logger.exception("testbed %s: teardown failed after an error", self.name)

    def close(self) -> None:
        """Kill the testbed's processes, delete its namespaces (and links); idempotent."""
        if self._iproute is None:
            return
        ignored = self._ignore_signals()  # a second Ctrl-C must not leave half a testbed
        try:
            destroy_testbed(self._iproute, self.leftovers())
            left = self.leftovers()
            if left:
                raise TestbedError(f"testbed {self.name}: left after teardown: {left}")
        finally:
            self._nodes = ()
            self._shaped = ()
            self._iproute = None
            self._restore_signals(ignored)
            self._restore_signals(self._saved_handlers)
            self._saved_handlers = {}

    def _build(self, iproute: IpRoute) -> None:
        hosts = list(self.network.hosts())[: self.nnodes]
        prefix = self.network.prefixlen
        nodes = tuple(
            Node(
                rank=rank,
                nnodes=self.nnodes,
                namespace=f"{self.name}-node{rank}",
                interface=f"veth{rank}",
                address=str(hosts[rank]),
                master_address=str(hosts[0]),
                iproute=iproute,
            )
            for rank in range(self.nnodes)
        )
        machine = socket.gethostname()
        for node in nodes:
            self._add_namespace(iproute, node.namespace)
            # The namespace's /etc/hosts: every node by name, this one by the machine's too.
            host_lines = ["127.0.0.1 localhost", "::1 localhost"]
            host_lines += [
                f"{other.address} node{other.rank}" + (f" {machine}" if other is node else "")
                for other in nodes
            ]
            (ETC_NETNS / node.namespace).mkdir(parents=True, exist_ok=True)
            (ETC_NETNS / node.namespace / "hosts").write_text("\n".join(host_lines) + "\n")
        shaped = [ShapedDevice(node.namespace, node.interface) for node in nodes]
        if self.switch_namespace is None:
            first, second = nodes
            self._add_veth(
                iproute, first.namespace, first.interface, second.namespace, second.interface
            )
        else:
            switch = self.switch_namespace
            self._add_namespace(iproute, switch)
            iproute.run_ip(
                "link", "add", "name", "br0", "type", "bridge", "stp_state", "0", netns=switch
            )
            for node in nodes:
                port = f"port{node.rank}"
                self._add_veth(iproute, node.namespace, node.interface, switch, port)
                iproute.run_ip("link", "set", port, "master", "br0", netns=switch)
                iproute.run_ip("link", "set", port, "up", netns=switch)
                shaped.append(ShapedDevice(switch, port))
            iproute.run_ip("link", "set", "br0", "mtu", str(self.mtu), "up", netns=switch)
        for node in nodes:
            if Path("/proc/sys/net/ipv6").exists():
                iproute.run_ip(
                    "link", "set", node.interface, "addrgenmode", "none", netns=node.namespace
                )
            iproute.run_ip(
                "addr",
                "add",
                f"{node.address}/{prefix}",
                "dev",
                node.interface,
                netns=node.namespace,
            )
        if self.rate is not None:
            for device in shaped:
                iproute.run_tc(
                    "qdisc", "replace", "dev", device.device, "root", "tbf",
                    "rate", self.rate.tc_argument,
                    "burst", f"{self.burst_bytes}b",
                    "latency", f"{self.latency_ms}ms",
                    netns=device.namespace,
                )  # fmt: skip
            self._shaped = tuple(shaped)
        for node in nodes:
            iproute.run_ip("link", "set", node.interface, "up", netns=node.namespace)
        self._wait_until_up(iproute, nodes)
        self._nodes = nodes

    def _add_namespace(self, iproute: IpRoute, namespace: str) -> None:
        iproute.run_ip("netns", "add", namespace)
        iproute.run_ip("link", "set", "lo", "up", netns=namespace)

    def _add_veth(
        self, iproute: IpRoute, namespace: str, device: str, peer_namespace: str, peer: str
    ) -> None:
        # Created straight inside the namespaces: no name ever exists in the host's namespace.
        iproute.run_ip(
            "link", "add", "name", device, "netns", namespace, "mtu", str(self.mtu),
            "type", "veth", "peer", "name", peer, "netns", peer_namespace, "mtu", str(self.mtu),
        )  # fmt: skip

    def _wait_until_up(self, iproute: IpRoute, nodes: Iterable[Node]) -> None:
        deadline = time.monotonic() + _GRACE_SECONDS
        for node in nodes:
            while iproute.link(node.namespace, node.interface)["operstate"] != "UP":
                if time.monotonic() > deadline:
                    raise TestbedError(f"{node.interface} on node{node.rank} did not come up")
                time.sleep(0.02)

    def _catch_stop_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in _STOP_SIGNALS:
            if signal.getsignal(signum) is signal.SIG_DFL:
                self._saved_handlers[signum] = signal.signal(signum, _raise_interrupted)

    def _ignore_signals(self) -> dict[int, Any]:
        if threading.current_thread() is not threading.main_thread():
            return {}
        return {signum: signal.signal(signum, signal.SIG_IGN) for signum in _ALL_SIGNALS}

    @staticmethod
    def _restore_signals(handlers: Mapping[int, Any]) -> None:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)


def _raise_interrupted(signum: int, frame: FrameType | None) -> None:
    raise TestbedInterrupted(signum)


def stale_testbeds(iproute: IpRoute) -> dict[str, list[str]]:
    """Testbeds whose owner process is gone: instance name -> its namespaces (or their folders)."""
    stale: dict[str, list[str]] = {}
    etc = [path.name for path in ETC_NETNS.glob(f"{PREFIX}-*")]
    for namespace in sorted({*iproute.namespaces(), *etc}):
        match = _NAMESPACE.match(namespace)
        if match and not is_running(int(match["owner"])):
            stale.setdefault(match["instance"], []).append(namespace)
    return stale


def remove_stale_testbeds(iproute: IpRoute) -> list[str]:
    """Destroy every stale testbed; returns their instance names."""
    stale = stale_testbeds(iproute)
    for instance, namespaces in stale.items():
        logger.warning("removing stale testbed %s (its owner process is gone)", instance)
        destroy_testbed(iproute, namespaces)
    return sorted(stale)


def destroy_testbed(iproute: IpRoute, namespaces: Sequence[str]) -> None:
    """Kill the processes in ``namespaces`` (SIGTERM, then SIGKILL), delete the namespaces and
    their ``/etc/netns`` folders.

    Deleting a namespace deletes the links in it; the veth peers in other namespaces go too.
    """

    def living() -> set[int]:
        pids: set[int] = set()
        for namespace in namespaces:
            with contextlib.suppress(TestbedError):  # already gone
                pids.update(iproute.namespace_pids(namespace))
        pids.discard(os.getpid())
        return pids

    for signum in (signal.SIGTERM, signal.SIGKILL):
        pids = living()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)
        deadline = time.monotonic() + _GRACE_SECONDS
        while pids and time.monotonic() < deadline:
            time.sleep(0.05)
            pids = living()
        if not pids:
            break
    failures = []
    existing = set(iproute.namespaces())
    for namespace in namespaces:
        try:
            if namespace in existing:
                iproute.run_ip("netns", "delete", namespace)
            shutil.rmtree(ETC_NETNS / namespace, ignore_errors=True)
        except TestbedError as error:
            failures.append(str(error))
    if failures:
        raise TestbedError("; ".join(failures))
