"""Ports and processes of this machine, as the end-to-end tests and the benchmarks probe them."""

from __future__ import annotations

import socket
from pathlib import Path


def free_port() -> int:
    """A TCP port nothing listens on now, on loopback (for torch's rendezvous store)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def port_is_free(port: int) -> bool:
    """Whether nothing listens on ``port`` on loopback (closed connections in TIME_WAIT, which
    a killed server leaves, do not count)."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_pair() -> int:
    """A port P such that P and P + 1 (a node 0's tuning service, by default) are both free
    on loopback: a port the kernel hands out can have a busy neighbour."""
    for _ in range(50):
        port = free_port()
        if port < 65535 and port_is_free(port + 1):
            return port
    raise RuntimeError("no free pair of ports")


def is_running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie, or no process at all, is not)."""
    try:
        # The state follows the command name, which may itself hold spaces and parentheses.
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"
