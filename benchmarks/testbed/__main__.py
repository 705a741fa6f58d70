"""``python -m benchmarks.testbed``: bring up a shaped testbed, run a job on it, tear it down.

Commands:

* ``run``: ``distune-run`` (or, with ``--launcher torchrun``, plain torchrun) on every node,
  static rendezvous at node 0; the arguments after ``--`` are the launcher's (flags, then the
  training script and its arguments).
* ``exec``: any command on every node, one process per node; ``RANK``, ``WORLD_SIZE``,
  ``MASTER_ADDR``, ``MASTER_PORT``, ``NODE_RANK``, ``NNODES`` and ``GLOO_SOCKET_IFNAME`` are set,
  so a plain ``torch.distributed`` script with ``init_process_group("gloo")`` just works.
* ``cleanup``: delete testbeds whose owner process is gone.
* ``check``: say whether this machine can host a testbed (root, iproute2, and a trial
  3-node shaped testbed for the kernel's veth, bridge and tbf).

Exit codes: 0 every node succeeded; 1 a node failed; 2 bad arguments; 3 this machine cannot
host a testbed (not root, iproute2 missing); 128 + N when signal N interrupted it.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from benchmarks.testbed.distune_job import DISTUNE_RUN, TORCHRUN, run_distune
from benchmarks.testbed.errors import TestbedError, TestbedInterrupted, TestbedUnavailable
from benchmarks.testbed.network import (
    DEFAULT_BURST_BYTES,
    DEFAULT_LATENCY_MS,
    DEFAULT_MTU,
    Testbed,
    remove_stale_testbeds,
)
from benchmarks.testbed.node_jobs import NodeResult, run_on_nodes
from benchmarks.testbed.prerequisites import missing_prerequisites, require_prerequisites
from benchmarks.testbed.rate import rate_argument

_FAILED, _USAGE, _UNAVAILABLE = 1, 2, 3
_TAIL_LINES = 20


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.testbed",
        description="A shaped multi-node testbed on this machine (needs root).",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    jobs = argparse.ArgumentParser(add_help=False)
    jobs.add_argument("--nodes", type=int, default=2, help="number of nodes (default 2)")
    jobs.add_argument(
        "--rate",
        type=rate_argument,
        default=None,
        help="rate of every node's link in each direction, as tc writes it (1gbit, 500mbit); "
        "'none' or left out: unshaped",
    )
    jobs.add_argument(
        "--mtu", type=int, default=DEFAULT_MTU, help=f"link MTU (default {DEFAULT_MTU})"
    )
    jobs.add_argument(
        "--burst-bytes",
        "--burst_bytes",
        type=int,
        default=DEFAULT_BURST_BYTES,
        help="tbf burst (default 256 KiB)",
    )
    jobs.add_argument(
        "--latency-ms",
        "--latency_ms",
        type=int,
        default=DEFAULT_LATENCY_MS,
        help="tbf queue latency (default 200)",
    )
    jobs.add_argument(
        "--output",
        type=Path,
        default=None,
        help="directory for node<i>.log and results.json (default: a new one under /tmp)",
    )
    jobs.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="stop the job after this many seconds (default 600)",
    )
    jobs.add_argument("--quiet", action="store_true", help="do not stream the nodes' output")
    jobs.add_argument("job", nargs=argparse.REMAINDER, help="after --: the job's arguments")

    run = commands.add_parser("run", parents=[jobs], help="distune-run on every node")
    run.add_argument(
        "--launcher",
        choices=("distune-run", "torchrun"),
        default="distune-run",
        help="torchrun: plain torchrun instead of distune-run, for a baseline",
    )
    run.add_argument(
        "--nproc-per-node",
        "--nproc_per_node",
        type=int,
        default=1,
        help="workers per node (default 1)",
    )
    commands.add_parser("exec", parents=[jobs], help="a command on every node, one rank a node")
    commands.add_parser("cleanup", help="delete testbeds whose owner process is gone")
    commands.add_parser("check", help="say whether this machine can host a testbed")
    return parser


def _report(results: Sequence[NodeResult], quiet: bool) -> None:
    for result in results:
        ended = f"exit {result.returncode}" + (
            f" (stopped: {result.stopped})" if result.stopped else ""
        )
        print(f"node{result.rank}: {ended} after {result.seconds:.1f} s, output {result.output}")
        if quiet and not result.ok:
            tail = result.read_output().splitlines()[-_TAIL_LINES:]
            print("\n".join(f"  [node{result.rank}] {line}" for line in tail), file=sys.stderr)


def _run_job(args: argparse.Namespace) -> int:
    job = args.job[1:] if args.job[:1] == ["--"] else args.job
    if not job:
        print(
            f"error: give the job after --, e.g. `{args.command} --nodes 2 -- ...`", file=sys.stderr
        )
        return _USAGE
    output = args.output or Path(tempfile.mkdtemp(prefix="distune-testbed-"))
    options = {"timeout": args.timeout, "output_dir": output, "echo": not args.quiet}
    with Testbed(
        args.nodes,
        args.rate,
        mtu=args.mtu,
        burst_bytes=args.burst_bytes,
        latency_ms=args.latency_ms,
    ) as bed:
        print(bed.describe(), flush=True)
        if args.command == "run":
            launcher = TORCHRUN if args.launcher == "torchrun" else DISTUNE_RUN
            results = run_distune(
                bed, job, nproc_per_node=args.nproc_per_node, launcher=launcher, **options
            )
        else:
            results = run_on_nodes(bed.nodes, lambda node: job, **options)
    _report(results, args.quiet)
    return 0 if all(result.ok for result in results) else _FAILED


def _check() -> int:
    missing = missing_prerequisites()
    if missing:
        print("\n".join(missing), file=sys.stderr)
        return _UNAVAILABLE
    try:  # the kernel's side: veth, bridge and tbf, by building a small testbed
        with Testbed(3, "1gbit"):
            pass
    except TestbedError as error:
        print(f"cannot build a testbed: {error}", file=sys.stderr)
        return _UNAVAILABLE
    print("this machine can host a testbed (3 shaped nodes came up and went)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command of the CLI; returns the exit code."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "check":
            return _check()
        if args.command == "cleanup":
            removed = remove_stale_testbeds(require_prerequisites())
            print(f"removed {len(removed)} stale testbed(s)" + "".join(f"\n  {n}" for n in removed))
            return 0
        return _run_job(args)
    except TestbedUnavailable as error:
        print(f"error: {error}", file=sys.stderr)
        return _UNAVAILABLE
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return _USAGE
    except TestbedError as error:
        print(f"error: {error}", file=sys.stderr)
        return _FAILED
    except TestbedInterrupted as interrupt:
        print(f"interrupted by signal {interrupt.signum}: testbed torn down", file=sys.stderr)
        return 128 + interrupt.signum
    except KeyboardInterrupt:
        print("interrupted: testbed torn down", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
