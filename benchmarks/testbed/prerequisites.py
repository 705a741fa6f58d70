"""What this machine must offer before a testbed can come up: root and iproute2."""

from __future__ import annotations

import os
from pathlib import Path

from benchmarks.testbed.errors import TestbedUnavailable
from benchmarks.testbed.iproute import IpRoute, find_tool

#: Capability bits (linux/capability.h): links and qdiscs, and namespace mounts.
_CAPABILITIES = {"CAP_NET_ADMIN": 12, "CAP_SYS_ADMIN": 21}


def _effective_capabilities() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)
    return 0


def missing_prerequisites() -> list[str]:
    """One line per missing prerequisite; empty when a testbed can come up here."""
    missing = []
    if os.geteuid() != 0:
        missing.append(
            "the testbed needs root (network namespaces, veth links and tc qdiscs need "
            "CAP_NET_ADMIN): run it with sudo"
        )
    else:
        effective = _effective_capabilities()
        lacking = [name for name, bit in _CAPABILITIES.items() if not effective >> bit & 1]
        if lacking:
            missing.append(
                f"root here lacks {' and '.join(lacking)} (a container without "
                "--privileged?): network namespaces cannot be made"
            )
    missing += [
        f"`{name}` (iproute2) not found: install the iproute2 package"
        for name in ("ip", "tc")
        if find_tool(name) is None
    ]
    return missing


def require_prerequisites() -> IpRoute:
    """The iproute2 tools; raises :class:`TestbedUnavailable` listing everything missing."""
    missing = missing_prerequisites()
    if missing:
        raise TestbedUnavailable("cannot build a testbed on this machine: " + "; ".join(missing))
    return IpRoute.locate()
