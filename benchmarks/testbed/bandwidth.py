"""Sanity figure: allreduce and TCP bandwidth through a shaped link against its configured rate.

Two nodes, one rank each, plain ``torch.distributed`` gloo. For each rate the script brings up a
fresh testbed and runs, on both nodes:

* a TCP stream from node 1 to node 0 for ``--seconds`` (goodput measured by the receiver);
* allreduces of one float32 tensor of ``--size-mib`` MiB, timed ``--repeats`` times over about
  ``--seconds`` each (the slowest rank's time).

Algorithm bandwidth is tensor bytes / seconds per allreduce. Bus bandwidth is algorithm
bandwidth x 2(n-1)/n: the bytes each rank sends on its link per second in a ring allreduce
(reduce-scatter then allgather, each moving (n-1)/n of the tensor), so it compares directly with
the link rate. With n = 2 the two are equal.

Usage (root)::

    python -m benchmarks.testbed.bandwidth --rates 1gbit 2gbit 5gbit none
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import sys
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path

from benchmarks.testbed.network import DEFAULT_BURST_BYTES, Testbed
from benchmarks.testbed.node_jobs import run_on_nodes
from benchmarks.testbed.rate import LinkRate, rate_argument

REPO = Path(__file__).resolve().parents[2]
_RESULT = "BANDWIDTH_RESULT "
_TCP_PORT = 29600
_CHUNK = 4 << 20


# --- on each node ------------------------------------------------------------------------------


def _tcp_goodput(rank: int, address: str, seconds: float, barrier: object) -> float | None:
    """Rank 1 streams to rank 0 for ``seconds``; rank 0 returns the bytes/s it received."""
    if rank > 1:
        barrier()  # type: ignore[operator]
        return None
    if rank == 0:
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
    payload = bytes(_CHUNK)
    with socket.create_connection((address, _TCP_PORT)) as connection:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            connection.sendall(payload)
    return None


def run_worker(size_bytes: int, seconds: float, repeats: int) -> None:
    """One rank of the measurement; rank 0 prints the result line."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    tcp = _tcp_goodput(rank, os.environ["MASTER_ADDR"], seconds, dist.barrier)
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


def measure(rate: LinkRate | None, args: argparse.Namespace) -> dict:
    """Bring up a 2-node testbed at ``rate``, run the workers, return node 0's figures."""
    command = [
        sys.executable, "-m", "benchmarks.testbed.bandwidth", "--worker",
        "--size-mib", str(args.size_mib), "--seconds", str(args.seconds),
        "--repeats", str(args.repeats),
    ]  # fmt: skip
    name = str(rate) if rate else "unshaped"
    with Testbed(nodes=2, rate=rate, burst_bytes=args.burst_bytes) as bed:
        results = run_on_nodes(
            bed.nodes,
            lambda node: command,
            output_dir=args.output / name,
            timeout=60 + 3 * args.seconds * (args.repeats + 2),
            env={"PYTHONPATH": str(REPO)},
        )
        counters = [node.link_counters() for node in bed.nodes]
    failed = [result for result in results if not result.ok]
    if failed:
        raise RuntimeError(f"{name}: node{failed[0].rank} failed, see {failed[0].output}")
    (line,) = [
        line[len(_RESULT) :]
        for line in results[0].read_output().splitlines()
        if line.startswith(_RESULT)
    ]
    figures = json.loads(line)
    figures["rate_bits_per_second"] = rate.bits_per_second if rate else None
    figures["link_tx_bytes"] = [c.tx_bytes for c in counters]
    return figures


def table(rows: Sequence[dict], mtu: int) -> list[str]:
    """The Markdown table of the figures (Gbit/s; percentages of the configured rate)."""
    lines = [
        "| link rate | payload ceiling | TCP goodput | allreduce algbw (median, min-max) "
        "| allreduce busbw | busbw / rate |",
        "|---|---|---|---|---|---|",
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
            f"| {label} | {ceiling} | {tcp_text} | {_gbit(median):.3f} "
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
    rows = [measure(rate, args) for rate in args.rates]
    lines = table(rows, mtu=9000)
    print(
        f"{started}, {args.size_mib} MiB float32 gloo allreduce, 2 nodes x 1 rank, "
        f"tbf burst {args.burst_bytes} bytes"
    )
    print("\n".join(lines))
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "bandwidth.json").write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
