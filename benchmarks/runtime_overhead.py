"""Step time of distune's DistributedDataParallel vs torch's, at the same bucket size.

Two ranks (gloo, one process per rank on this machine) train three copies of the same MLP
(~15M parameters) in one run: compute only (no communication: the floor), torch's
``DistributedDataParallel`` and distune's, both with buckets of ``--bucket-size`` bytes. The
variants are interleaved step by step (round r runs one step of each, in an order rotating with
r), so whatever else loads the machine hits all of them alike; the figures that matter are the
ratios: of the medians, and the median of the per-round ratios distune/torch.

    .venv/bin/python benchmarks/runtime_overhead.py             # prints a JSON summary
    .venv/bin/python benchmarks/runtime_overhead.py --rounds 200 --output result.json
    .venv/bin/python benchmarks/runtime_overhead.py --testbed 2gbit   # 2 namespaces (root)

A step is ``zero_grad``, forward, backward (gradients averaged), ``optimizer.step()`` (SGD).
Both engines run with torch DDP's default ``broadcast_buffers=True`` (``--no-broadcast-buffers``
turns it off for both); ``--batch-norm`` puts a BatchNorm1d after each hidden layer, so there
are buffers to broadcast before every forward:

    .venv/bin/python benchmarks/runtime_overhead.py --batch-norm
    .venv/bin/python benchmarks/runtime_overhead.py --batch-norm --no-broadcast-buffers

With ``--testbed RATE`` the ranks run on the shaped testbed (``benchmarks/testbed``) instead of
loopback: ``--nodes`` network namespaces joined by links shaped to RATE, ``--nproc`` ranks on
each (started by torchrun in every namespace), so the gradients cross a real bottleneck link.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from datetime import date, timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import distune

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: find benchmarks/
from benchmarks.testbed.rate import LinkRate
from tests.support.local_host import free_port

VARIANTS = ("compute", "torch", "distune")


def mlp(io: int, width: int, layers: int, batch_norm: bool = False) -> nn.Module:
    """``layers`` Linear layers io -> width -> ... -> width -> io, ReLU between them (after a
    BatchNorm1d with ``batch_norm``).

    The default (1024, 2304, 4) has 15.3M parameters in 8 tensors; (8, 8, 40) has 80 tiny
    parameters, which shows the per-parameter cost of the hooks.
    """
    torch.manual_seed(0)
    sizes = [io] + [width] * (layers - 1) + [io]
    modules: list[nn.Module] = []
    for fan_in, fan_out in itertools.pairwise(sizes):
        modules.append(nn.Linear(fan_in, fan_out))
        if batch_norm:
            modules.append(nn.BatchNorm1d(fan_out))
        modules.append(nn.ReLU())
    return nn.Sequential(*modules[: -2 if batch_norm else -1])


def _rank_main(rank: int, args: argparse.Namespace, port: int, queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    dist.init_process_group(
        "gloo", rank=rank, world_size=args.nproc, timeout=timedelta(seconds=120)
    )
    raw = _measure(rank, args)
    if rank == 0:
        queue.put(raw)


def _testbed_rank_main(args: argparse.Namespace) -> None:
    """One rank on the testbed, started by torchrun: the process group comes from its
    environment; rank 0 writes the raw figures to ``--worker-output``."""
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    rank = dist.get_rank()
    raw = _measure(rank, args)
    if rank == 0:
        with open(args.worker_output, "w") as out:
            json.dump(raw, out)


def _measure(rank: int, args: argparse.Namespace) -> dict[str, Any]:
    """Every variant, step by step interleaved; rank 0's figures (the group is torn down)."""
    shape = (args.io, args.width, args.layers, args.batch_norm)
    broadcast = args.broadcast_buffers
    models = {
        "compute": mlp(*shape),
        "torch": nn.parallel.DistributedDataParallel(
            mlp(*shape), bucket_cap_mb=args.bucket_size / 2**20, broadcast_buffers=broadcast
        ),
        "distune": distune.DistributedDataParallel(
            mlp(*shape), bucket_cap_mb=args.bucket_size / 2**20, broadcast_buffers=broadcast
        ),
    }
    optimizers = {k: torch.optim.SGD(m.parameters(), lr=1e-4) for k, m in models.items()}
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, args.io, generator=generator)
    y = torch.randn(args.batch, args.io, generator=generator)
    times: dict[str, list[float]] = {k: [] for k in VARIANTS}
    cpu_times: dict[str, list[float]] = {k: [] for k in VARIANTS}
    faults: dict[str, list[int]] = {k: [] for k in VARIANTS}
    for round_ in range(args.warmup + args.rounds):
        order = VARIANTS[round_ % 3 :] + VARIANTS[: round_ % 3]
        for name in order:
            model, optimizer = models[name], optimizers[name]
            dist.barrier()  # both ranks start each step together, compute-only included
            faults_before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            started, cpu_started = time.perf_counter(), time.process_time()
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            if round_ >= args.warmup:  # warm-up: first-iteration bucket rebuilds, allocator
                times[name].append(time.perf_counter() - started)
                # CPU seconds of all this rank's threads (gloo's included): the engine's work,
                # less sensitive than wall time to what else runs on the machine.
                cpu_times[name].append(time.process_time() - cpu_started)
                # Pages the allocator had to fault in again: memory churn costs CPU too.
                faults[name].append(
                    resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_before
                )
    parameters = sum(p.numel() for p in models["compute"].parameters())
    buckets = len(models["distune"]._reducer.bucket_sizes)
    world_size = dist.get_world_size()
    dist.destroy_process_group()
    return {
        "times": times,
        "cpu": cpu_times,
        "faults": faults,
        "parameters": parameters,
        "distune_buckets": buckets,
        "world_size": world_size,
    }


def summarize(raw: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Medians per variant and the ratios that BENCHMARKS.md records."""
    times = raw["times"]
    medians = {k: statistics.median(times[k]) for k in VARIANTS}
    paired = [ours / theirs for ours, theirs in zip(times["distune"], times["torch"], strict=True)]
    quartiles = statistics.quantiles(paired, n=4)
    return {
        "date": date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
        "torch": torch.__version__,
        "network": (
            f"testbed: {args.nodes} nodes x {args.nproc} ranks, links shaped to {args.testbed}"
            if args.testbed
            else "loopback"
        ),
        "load_average": list(os.getloadavg()),
        "ranks": raw["world_size"],
        "threads_per_rank": args.threads,
        "model": f"MLP io={args.io} width={args.width} layers={args.layers}"
        + (" with BatchNorm1d" if args.batch_norm else ""),
        "broadcast_buffers": args.broadcast_buffers,
        "parameters": raw["parameters"],
        "batch": args.batch,
        "bucket_size": args.bucket_size,
        "distune_buckets": raw["distune_buckets"],
        "steps_per_variant": args.rounds,
        "median_step_ms": {k: round(1000 * v, 2) for k, v in medians.items()},
        "ratio_distune_vs_torch": round(medians["distune"] / medians["torch"], 3),
        "ratio_per_round": {
            "median": round(statistics.median(paired), 3),
            "q1": round(quartiles[0], 3),
            "q3": round(quartiles[2], 3),
        },
        "median_step_cpu_ms": {
            k: round(1000 * statistics.median(raw["cpu"][k]), 2) for k in VARIANTS
        },
        "median_minor_faults_per_step": {k: statistics.median(raw["faults"][k]) for k in VARIANTS},
        "communication_ms": {
            k: round(1000 * (medians[k] - medians["compute"]), 2) for k in ("torch", "distune")
        },
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--nproc", type=int, default=None, help="ranks (default 2; on the testbed: per node, 1)"
    )
    parser.add_argument(
        "--testbed",
        metavar="RATE",
        type=LinkRate.parse,
        help="run on the shaped testbed, links at RATE (e.g. 2gbit); needs root",
    )
    parser.add_argument("--nodes", type=int, default=2, help="testbed nodes (default 2)")
    parser.add_argument("--worker-output", help=argparse.SUPPRESS)  # a testbed rank, internal
    parser.add_argument("--io", type=int, default=1024, help="input and output width")
    parser.add_argument("--width", type=int, default=2304, help="hidden width (15.3M params)")
    parser.add_argument("--layers", type=int, default=4, help="Linear layers (default 4)")
    parser.add_argument(
        "--batch-norm", action="store_true", help="a BatchNorm1d after each hidden layer"
    )
    parser.add_argument(
        "--broadcast-buffers",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="both engines' broadcast_buffers (default: on, torch DDP's default)",
    )
    parser.add_argument("--batch", type=int, default=32, help="samples per rank and step")
    parser.add_argument(
        "--bucket-size", type=int, default=2**25, help="bytes, a power of two (default 2^25)"
    )
    parser.add_argument("--rounds", type=int, default=100, help="measured steps per variant")
    parser.add_argument("--warmup", type=int, default=5, help="unmeasured rounds first")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--output", help="also write the JSON summary here")
    args = parser.parse_args(argv)
    if args.bucket_size & (args.bucket_size - 1):
        parser.error("--bucket-size must be a power of two, so both engines use the same size")
    if args.nproc is None:
        args.nproc = 1 if args.testbed else 2
    if args.worker_output:
        _testbed_rank_main(args)
        return {}
    if args.testbed:
        raw = _run_on_testbed(args, argv if argv is not None else sys.argv[1:])
    else:
        context = mp.get_context("spawn")
        queue = context.SimpleQueue()
        mp.spawn(_rank_main, args=(args, free_port(), queue), nprocs=args.nproc)
        raw = queue.get()
    summary = summarize(raw, args)
    text = json.dumps(summary, indent=2)
    print(text)
    if args.output:
        with open(args.output, "w") as out:
            out.write(text + "\n")
    return summary


def _run_on_testbed(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    """This script's ranks under torchrun on every node of a shaped testbed; rank 0's figures."""
    from benchmarks.testbed import TORCHRUN, Testbed, run_distune

    with tempfile.TemporaryDirectory(prefix="distune-overhead-") as directory:
        raw_path = os.path.join(directory, "raw.json")
        script = [os.path.abspath(__file__), *argv, "--worker-output", raw_path]
        with Testbed(args.nodes, args.testbed) as bed:
            print(bed.describe(), file=sys.stderr, flush=True)
            results = run_distune(
                bed, script, nproc_per_node=args.nproc, launcher=TORCHRUN,
                output_dir=Path(directory), timeout=3600,
            )  # fmt: skip
        failed = [r for r in results if not r.ok]
        if failed:
            sys.exit(f"node {failed[0].rank} failed:\n{failed[0].read_output()[-3000:]}")
        with open(raw_path) as raw:
            return json.load(raw)


if __name__ == "__main__":
    main()
