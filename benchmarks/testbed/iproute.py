"""The iproute2 commands the testbed runs (``ip netns``, ``ip link``, ``ip addr``, ``tc``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

from benchmarks.testbed.errors import TestbedError, TestbedUnavailable

#: Where iproute2 lives when a non-root PATH leaves the sbin directories out.
_SBIN = ("/usr/sbin", "/sbin", "/usr/local/sbin")
#: Seconds any one ip/tc command may take; they normally take milliseconds.
_COMMAND_TIMEOUT = 30.0


def find_tool(name: str) -> str | None:
    """The path of the ``name`` executable on PATH or in the sbin directories, if any."""
    search = os.pathsep.join([os.environ.get("PATH", ""), *_SBIN])
    return shutil.which(name, path=search)


@dataclass(frozen=True)
class IpRoute:
    """Runs ``ip`` and ``tc``; a failing command raises :class:`TestbedError` with its stderr."""

    ip: str
    tc: str

    @classmethod
    def locate(cls) -> IpRoute:
        """Find both tools; raises :class:`TestbedUnavailable` naming the missing ones."""
        found = {name: find_tool(name) for name in ("ip", "tc")}
        missing = [name for name, path in found.items() if path is None]
        if missing:
            raise TestbedUnavailable(
                f"iproute2 is missing ({', '.join(missing)} not found on PATH or in "
                f"{', '.join(_SBIN)}); install the iproute2 package"
            )
        return cls(ip=found["ip"], tc=found["tc"])  # type: ignore[arg-type]

    def run_ip(self, *args: str, netns: str | None = None) -> str:
        """``ip [-n NETNS] ARGS``; returns its stdout."""
        return self._run([self.ip, *(("-n", netns) if netns else ()), *args])

    def run_tc(self, *args: str, netns: str | None = None) -> str:
        """``tc [-n NETNS] ARGS``; returns its stdout."""
        return self._run([self.tc, *(("-n", netns) if netns else ()), *args])

    def exec_argv(self, netns: str, command: Sequence[str]) -> list[str]:
        """The argv that runs ``command`` inside network namespace ``netns``."""
        return [self.ip, "netns", "exec", netns, *command]

    def namespaces(self) -> list[str]:
        """Names of all named network namespaces (``ip netns list``)."""
        # Lines read "NAME" or "NAME (id: N)".
        return [line.split()[0] for line in self.run_ip("netns", "list").splitlines() if line]

    def namespace_pids(self, netns: str) -> list[int]:
        """Pids of the processes living in ``netns``."""
        return [int(pid) for pid in self.run_ip("netns", "pids", netns).split()]

    def link(self, netns: str, device: str) -> dict:
        """``ip -j -s link show`` of one device, as the JSON object iproute2 prints."""
        (info,) = json.loads(self.run_ip("-j", "-s", "link", "show", "dev", device, netns=netns))
        return info

    def qdiscs(self, netns: str, device: str) -> list[dict]:
        """``tc -j qdisc show`` of one device, as JSON objects."""
        return json.loads(self.run_tc("-j", "qdisc", "show", "dev", device, netns=netns))

    def _run(self, argv: list[str]) -> str:
        try:
            done = subprocess.run(
                argv, capture_output=True, text=True, timeout=_COMMAND_TIMEOUT, check=False
            )
        except subprocess.TimeoutExpired as error:
            raise TestbedError(f"`{' '.join(argv)}` took over {_COMMAND_TIMEOUT:.0f} s") from error
        if done.returncode != 0:
            detail = done.stderr.strip() or done.stdout.strip() or f"exit code {done.returncode}"
            hint = ""
            if "qdisc kind is unknown" in detail:
                hint = " (the kernel lacks that queueing discipline: load the sch_tbf module)"
            elif "Unknown device type" in detail or "not supported" in detail.lower():
                hint = " (the kernel lacks veth or bridge support: load the veth/bridge modules)"
            raise TestbedError(f"`{' '.join(argv)}` failed: {detail}{hint}")
        return done.stdout
