"""Sanity figure: allreduce and TCP bandwidth through a shaped link against its configured rate.

Two nodes, one rank each (plain ``torch.distributed`` gloo) or N ranks each (under torchrun).
For each rate the script brings up a fresh testbed and runs:

* a TCP stream from node 1 to node 0 for ``--seconds`` (goodput measured by the receiver);
* allreduces of one float32 tensor of ``--size-mib`` MiB, timed ``--repeats`` times over about
  ``--seconds`` each (the slowest rank's time).

Algorithm bandwidth (algbw) is tensor bytes / seconds per allreduce. Bus bandwidth (busbw) is
algbw x 2(n-1)/n for n ranks: what each rank sends per second in a ring allreduce
(reduce-scatter then allgather, each moving (n-1)/n of the tensor). Ranks are numbered node by
node, so the ring crosses each node's link once per direction and busbw is also the rate on the
link: it compares directly with the configured rate. With 2 x 1 ranks, busbw = algbw.

Usage (root)::

    python -m benchmarks.testbed.bandwidth --rates 1gbit 2gbit 5gbit none
    python -m benchmarks.testbed.bandwidth --rates 1gbit 2gbit 5gbit --nproc-per-node 2
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import socket
import statistics
import sys
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path

from benchmarks.testbed.distune_job import TORCHRUN, launcher_argv
from benchmarks.testbed.network import DEFAULT_BURST_BYTES, Node, Testbed
from benchmarks.testbed.node_jobs import node0_result, run_on_nodes
from benchmarks.testbed.rate import LinkRate, rate_argument

REPO = Path(__file__).resolve().parents[2]
_RESULT = "BANDWIDTH_RESULT "
_TCP_PORT = 29600
_CHUNK = 4 << 20


# --- on each node ------------------------------------------------------------------------------


def _tcp_goodput(role: str, address: str, seconds: float, barrier: object) -> float | None:
    """The sender streams to the receiver for ``seconds``; the receiver returns its bytes/s."""
    if role == "receiver":
        with socket.create_server((address, _TCP_PORT)) as server:
            barrier()  # type: ignore[operator]
            connection, _ = server.accept()
            with connection:
                received = len(connection.recv(_CHUNK))
                start = time.perf_counter()
                while data := connection.recv(_CHUNK):
                    received += len(data)
                return received / (time.perf_counter() - start)
    barrier()  # type: ignore[operator]
    if role == "sender":
        payload = bytes(_CHUNK)
        with socket.create_connection((address, _TCP_PORT)) as connection:
            end = time.perf_counter() + seconds
            while time.perf_counter() < end:
                connection.sendall(payload)
    return None


def run_worker(size_bytes: int, seconds: float, repeats: int) -> None:
    """One rank of the measurement (plain script or under torchrun); rank 0 prints the result."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    # Node 1's first rank streams to node 0's first rank, across the link.
    role = {0: "receiver", per_node: "sender"}.get(rank, "idle")
    tcp = _tcp_goodput(role, os.environ["MASTER_ADDR"], seconds, dist.barrier)
    dist.barrier()

    tensor = torch.zeros(size_bytes // 4, dtype=torch.float32)
    start = time.perf_counter()
    dist.all_reduce(tensor)  # warm-up; also sizes the timed loops
    iterations = torch.tensor([max(2, math.ceil(seconds / (time.perf_counter() - start)))])
    dist.broadcast(iterations, 0)  # every rank runs the same number of allreduces
    samples = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(int(iterations)):
            dist.all_reduce(tensor)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's time
        samples.append(float(elapsed) / int(iterations))
    if rank == 0:
        result = {
            "world_size": world,
            "ranks_per_node": per_node,
            "tensor_bytes": tensor.numel() * 4,
            "iterations": int(iterations),
            "seconds_per_allreduce": samples,
            "tcp_goodput_bytes_per_second": tcp,
        }
        print(_RESULT + json.dumps(result), flush=True)
    dist.destroy_process_group()


# --- the driver --------------------------------------------------------------------------------


def _gbit(bytes_per_second: float) -> float:
    return bytes_per_second * 8 / 1e9


def _worker_command(node: Node, args: argparse.Namespace) -> list[str]:
    worker = [
        "-m", "benchmarks.testbed.bandwidth", "--worker", "--size-mib", str(args.size_mib),
        "--seconds", str(args.seconds), "--repeats", str(args.repeats),
    ]  # fmt: skip
    if args.nproc_per_node == 1:
        return [sys.executable, *worker]
    return launcher_argv(node, args.nproc_per_node, worker, launcher=TORCHRUN)


def measure(rate: LinkRate | None, args: argparse.Namespace) -> dict:
    """Bring up a 2-node testbed at ``rate``, run the workers, return rank 0's figures."""
    name = f"{rate or 'unshaped'}-2x{args.nproc_per_node}"
    with Testbed(nodes=2, rate=rate, burst_bytes=args.burst_bytes) as bed:
        results = run_on_nodes(
            bed.nodes,
            lambda node: _worker_command(node, args),
            output_dir=args.output / name,
            timeout=60 + 3 * args.seconds * (args.repeats + 2),
            env={"PYTHONPATH": str(REPO)},
        )
    figures = node0_result(results, _RESULT, name)
    figures["rate_bits_per_second"] = rate.bits_per_second if rate else None
    return figures


def table(rows: Sequence[dict], mtu: int) -> list[str]:
    """The Markdown table of the figures (Gbit/s; percentages of the configured rate)."""
    lines = [
        "| link rate | nodes x ranks | payload ceiling | TCP goodput "
        "| allreduce algbw (median, min-max) | allreduce busbw | busbw / rate |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        world = row["world_size"]
        size = row["tensor_bytes"]
        algbw = sorted(size / seconds for seconds in row["seconds_per_allreduce"])
        median = statistics.median(algbw)
        busbw = median * 2 * (world - 1) / world
        rate = row["rate_bits_per_second"]
        tcp = row["tcp_goodput_bytes_per_second"]
        if rate:
            label = str(LinkRate(rate))
            ceiling = f"{_gbit(LinkRate(rate).payload_bytes_per_second(mtu)):.3f}"
            share = f"{busbw * 8 / rate:.1%}"
            tcp_text = f"{_gbit(tcp):.3f} ({tcp * 8 / rate:.1%})"
        else:
            ceiling, label, share, tcp_text = "-", "unshaped", "-", f"{_gbit(tcp):.3f}"
        lines.append(
            f"| {label} | 2x{row['ranks_per_node']} | {ceiling} | {tcp_text} | {_gbit(median):.3f} "
            f"({_gbit(algbw[0]):.3f}-{_gbit(algbw[-1]):.3f}) | {_gbit(busbw):.3f} | {share} |"
        )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """Measure every rate, print the table, write the raw figures as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--rates", nargs="+", type=rate_argument, default=["1gbit", "2gbit", "5gbit", "none"]
    )
    parser.add_argument("--size-mib", type=int, default=64, help="allreduce tensor size")
    parser.add_argument("--seconds", type=float, default=4.0, help="per timed repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--nproc-per-node", type=int, default=1, help="ranks a node (torchrun)")
    parser.add_argument(
        "--burst-bytes", type=int, default=DEFAULT_BURST_BYTES, help="tbf burst (default 256 KiB)"
    )
    parser.add_argument("--output", type=Path, default=Path("/tmp/distune-testbed-bandwidth"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        run_worker(args.size_mib << 20, args.seconds, args.repeats)
        return 0
    started = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    load_before = os.getloadavg()[0]
    rows = [measure(rate, args) for rate in args.rates]
    load_after = os.getloadavg()[0]
    lines = table(rows, mtu=9000)
    print(
        f"{started}, {platform.system()} {platform.release()}, {os.cpu_count()} CPUs, "
        f"1-min load average {load_before:.1f} before, {load_after:.1f} after; "
        f"{args.size_mib} MiB float32 gloo allreduce, 2 nodes x {args.nproc_per_node} ranks, "
        f"tbf burst {args.burst_bytes} bytes"
    )
    print("\n".join(lines))
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "bandwidth.json").write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
