"""Which node runs the tuning service, on which address, and the URL every worker uses.

A single-node job keeps the service on loopback, on a free port. A multi-node job runs it on one
node only, bound to the address the other nodes reach it by, on a port every node can compute
without talking to the others:

* static rendezvous: node_rank 0 hosts it, at ``--master_addr``;
* other rendezvous backends (c10d, ...): the node that torch's ``--rdzv_conf is_host=...`` names
  as the store's host when it is given (needed where several nodes share one machine); else the
  node that owns the rendezvous endpoint's address, or ``--autotune_service_addr``'s when given;
* the port is ``--autotune_service_port``, else the URL's, else the rendezvous port + 1.

The service listens on the URL's address only, never on every interface, unless
``--autotune_service_bind`` asks for it: e.g. ``0.0.0.0`` in a container whose address differs
from the one the other nodes use (published ports behind NAT). A wildcard address (``0.0.0.0``,
``::``) in the workers' URL is refused: no worker can reach a service there. So is, on the node
that hosts the service, a URL address that is not this machine's when no bind address is given:
the service could not listen there.
"""

from __future__ import annotations

import argparse
import errno
import ipaddress
import socket
from dataclasses import dataclass
from urllib.parse import SplitResult, urlsplit

from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.utils import _parse_rendezvous_config
from torch.distributed.run import parse_min_max_nnodes

from distune.launcher.options import AutotuneOptions, OptionError

LOOPBACK = "127.0.0.1"
#: torchrun's defaults, used when the command line leaves the rendezvous port unsaid.
DEFAULT_MASTER_PORT = 29500
DEFAULT_C10D_PORT = 29400


@dataclass(frozen=True)
class ServicePlacement:
    """Where the tuning service of this job runs, as seen from this node.

    ``host`` is where the workers reach it, ``bind`` where it listens. ``port`` 0 means a free
    port picked when the service starts (single-node only), so the workers' URL is known only
    then.
    """

    hosted_here: bool
    host: str
    port: int
    multi_node: bool
    bind: str

    @property
    def url(self) -> str:
        """The URL workers use (for a hosted port-0 service, the port is filled in at start)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


def is_local_address(host: str) -> bool:
    """Whether ``host`` names an address of this machine: binding to it succeeds only then."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return False
    for family, _, _, _, address in infos:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((address[0], 0))
            except OSError:
                continue
            return True
    return False


def _addresses(host: str) -> set[str]:
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return set()
    return {str(info[4][0]).split("%", 1)[0] for info in infos}


def port_taken(placement: ServicePlacement) -> bool:
    """Whether something holds the service's fixed port where it listens."""
    if placement.port == 0:
        return False
    family = socket.AF_INET6 if ":" in placement.bind else socket.AF_INET
    with socket.socket(family) as probe:
        try:
            probe.bind((placement.bind, placement.port))
        except OSError as error:
            return error.errno == errno.EADDRINUSE
    return False


def is_wildcard_address(host: str) -> bool:
    """Whether ``host`` means every interface (``0.0.0.0``, ``::``, or a spelling of them)."""
    return any(ipaddress.ip_address(address).is_unspecified for address in _addresses(host))


def _reachable_host(host: str, source: str) -> str:
    """``host`` if workers can connect to it; a wildcard is refused, naming ``source``."""
    if is_wildcard_address(host):
        raise OptionError(
            f"{source}: {host} means every interface, which no worker can connect to; give the "
            "address the workers use, and --autotune_service_bind 0.0.0.0 to listen on every "
            "interface"
        )
    return host


def _bind_address(options: AutotuneOptions) -> str | None:
    bind = options.autotune_service_bind
    if bind is not None and not is_local_address(bind):
        raise OptionError(
            f"--autotune_service_bind {bind}: not an address of this machine, so the service "
            "cannot listen there"
        )
    return bind


def _given_port(given: SplitResult) -> int:
    # --autotune_service_addr's check (options._url) refuses a URL without a port.
    assert given.port is not None, given
    return given.port


def _single_node_placement(options: AutotuneOptions, given: SplitResult | None) -> ServicePlacement:
    bind = _bind_address(options)
    port = _given_port(given) if given is not None else (options.autotune_service_port or 0)
    if given is None:
        # The workers connect from this machine: to the bound address (loopback for a wildcard).
        host = LOOPBACK if bind is None else bind
        if is_wildcard_address(host):
            host = "::1" if ":" in host else LOOPBACK
    else:
        flag = f"--autotune_service_addr {options.autotune_service_addr}"
        host = _reachable_host(str(given.hostname), flag)
        if not is_local_address(host):
            raise OptionError(
                f"{flag}: a single-node job hosts its service itself, so the address must be "
                "one of this machine's"
            )
        listens_elsewhere = bind is not None and not is_wildcard_address(bind)
        if listens_elsewhere and not _addresses(str(bind)) & _addresses(host):
            raise OptionError(
                f"{flag}: the service listens on --autotune_service_bind {bind} only, so the "
                "workers cannot reach it there"
            )
    return ServicePlacement(
        hosted_here=True, host=host, port=port, multi_node=False, bind=bind or host
    )


def _split_endpoint(endpoint: str, default_port: int) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    if not host:  # no port given
        return endpoint.strip("[]"), default_port
    return host.strip("[]"), int(port) if port.isdigit() else default_port


def _configured_host(args: argparse.Namespace) -> bool | None:
    """torch's own ``is_host`` rendezvous option, read as torch reads it; None when unset."""
    try:
        config = _parse_rendezvous_config(args.rdzv_conf)
        return RendezvousParameters(
            args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id, 1, 1, **config
        ).get_as_bool("is_host")
    except ValueError as error:
        raise OptionError(f"--rdzv_conf {args.rdzv_conf!r}: {error}") from None


def _store_endpoint(args: argparse.Namespace, multi_node: bool) -> tuple[str, int] | None:
    """Where torch's rendezvous store listens when the command line fixes it (static or c10d
    rendezvous); None where torch picks a free port (``--standalone``, one node without
    ``--master_port``) or another backend keeps its own store."""
    if args.standalone or args.rdzv_backend not in ("static", "c10d"):
        return None
    if args.rdzv_backend == "static" and not args.rdzv_endpoint:
        if args.master_port is None and not multi_node:
            return None
        return args.master_addr, args.master_port or DEFAULT_MASTER_PORT
    default = DEFAULT_MASTER_PORT if args.rdzv_backend == "static" else DEFAULT_C10D_PORT
    return _split_endpoint(args.rdzv_endpoint, default)


#: torch's static rendezvous time-out when ``--rdzv_conf timeout=`` leaves it unsaid.
STATIC_RENDEZVOUS_TIMEOUT = 600


def rendezvous_wait(args: argparse.Namespace) -> str | None:
    """What a node of a multi-node job with static rendezvous waits for, said before it joins:
    torch waits for the other nodes silently, up to its time-out (node 0 with its store up, the
    others until it answers). None for any other job (one node, another backend)."""
    _, max_nodes = parse_min_max_nnodes(args.nnodes)
    store = _store_endpoint(args, multi_node=True)
    if max_nodes < 2 or args.rdzv_backend != "static" or store is None:
        return None
    try:
        config = _parse_rendezvous_config(args.rdzv_conf)
        timeout = RendezvousParameters(
            args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id, 1, 1, **config
        ).get_as_int("timeout", STATIC_RENDEZVOUS_TIMEOUT)
    except ValueError:
        return None  # torch refuses it itself, saying why
    host, port = store
    return (
        f"node {args.node_rank} of {max_nodes}: waiting for the other nodes in torch's static "
        f"rendezvous at {host}:{port} (up to {timeout} s; --rdzv_conf timeout=S changes it)"
    )


def _check_store_port(
    args: argparse.Namespace, placement: ServicePlacement, options: AutotuneOptions
) -> None:
    """The service's port must not be the rendezvous store's on the same host: whichever
    starts second fails (torch's with a traceback, after the service has started)."""
    store = _store_endpoint(args, placement.multi_node)
    if store is None or placement.port == 0 or placement.port != store[1]:
        return  # port 0: a free port each, picked as they start
    # On one node the store listens on every interface; on several, compare the addresses.
    if placement.multi_node and not _addresses(store[0]) & _addresses(placement.host):
        return
    flag = (
        f"--autotune_service_addr {options.autotune_service_addr}"
        if options.autotune_service_addr
        else f"--autotune_service_port {placement.port}"
    )
    source = (
        "--rdzv_endpoint"
        if args.rdzv_endpoint
        else "--master_port"
        if args.master_port
        else "torch's default --master_port"
    )
    raise OptionError(
        f"{flag}: port {placement.port} is the rendezvous store's ({source}), where torch "
        "listens on the same host; give the tuning service another port"
    )


def place_service(args: argparse.Namespace, options: AutotuneOptions) -> ServicePlacement:
    """Decide this node's role from torchrun's rendezvous flags and the autotune options."""
    placement = _placement(args, options)
    _check_store_port(args, placement, options)
    return placement


def _foreign_service_address(args: argparse.Namespace, options: AutotuneOptions, host: str) -> str:
    """Why this node cannot host the service at ``host``, and what it may be given instead."""
    if options.autotune_service_addr:
        source = f"--autotune_service_addr {options.autotune_service_addr}"
    elif args.rdzv_endpoint:
        source = f"--rdzv_endpoint {args.rdzv_endpoint} (the service's default address)"
    else:
        source = f"--master_addr {host} (the service's default address)"
    what = "is not an address of this machine" if _addresses(host) else "does not resolve here"
    node = "node 0" if args.rdzv_backend == "static" else "the node that hosts the service"
    return (
        f"{source}: {host} {what}, and {node} (this one) listens there; give one of this "
        "machine's addresses, or, where the other nodes reach it through another address "
        "(NAT, published ports), also --autotune_service_bind with a local address or 0.0.0.0"
    )


def _placement(args: argparse.Namespace, options: AutotuneOptions) -> ServicePlacement:
    _, max_nodes = parse_min_max_nnodes(args.nnodes)
    multi_node = max_nodes > 1 and not args.standalone
    given = urlsplit(options.autotune_service_addr) if options.autotune_service_addr else None
    if given is not None and options.autotune_service_port not in (None, given.port):
        raise OptionError(
            f"--autotune_service_port {options.autotune_service_port} contradicts "
            f"--autotune_service_addr {options.autotune_service_addr}"
        )

    if not multi_node:
        return _single_node_placement(options, given)

    if args.rdzv_backend == "static" and not args.rdzv_endpoint:
        rdzv_host = args.master_addr
        rdzv_port = args.master_port or DEFAULT_MASTER_PORT
    else:
        default = DEFAULT_MASTER_PORT if args.rdzv_backend == "static" else DEFAULT_C10D_PORT
        rdzv_host, rdzv_port = _split_endpoint(args.rdzv_endpoint, default)
    if given is not None:
        host = _reachable_host(
            str(given.hostname), f"--autotune_service_addr {options.autotune_service_addr}"
        )
    else:
        source = "--rdzv_endpoint" if args.rdzv_endpoint else "--master_addr"
        host = _reachable_host(rdzv_host, f"{source} {rdzv_host} (the service's default address)")
    if given is not None:
        port = _given_port(given)
    elif options.autotune_service_port is not None:
        port = options.autotune_service_port
    else:
        port = rdzv_port + 1
    if port == 0:
        raise OptionError(
            "--autotune_service_port 0 (a free port) works for a single node only: "
            "the other nodes must know the port in advance"
        )
    if args.rdzv_backend == "static":
        hosted_here = int(args.node_rank) == 0
    else:
        # The service sits with the c10d store: the node told to host it, or else the one owning
        # the address (both nodes own it when they share a machine, so is_host must decide there).
        configured = _configured_host(args)
        hosted_here = is_local_address(host) if configured is None else configured
    bind = _bind_address(options) if hosted_here else None
    if hosted_here and bind is None and not is_local_address(host):
        # It would listen on the workers' address: caught here, before anything starts, rather
        # than as "cannot assign requested address" once the service does.
        raise OptionError(_foreign_service_address(args, options, host))
    return ServicePlacement(
        hosted_here=hosted_here, host=host, port=port, multi_node=True, bind=bind or host
    )
