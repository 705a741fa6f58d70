"""What zero1's parameter broadcast costs on a shaped link: seconds and bytes, against line rate.

Two nodes, one rank each (plain ``torch.distributed`` gloo), the GPT example's model at the
level-2 testbed jobs' size. Each rank builds one model per variant from the same seed, each with
its own ``ZeroRedundancyOptimizer`` (AdamW), and runs, in interleaved blocks (A B B A ...):

* ``step``: the optimizer step on the same random gradients (local AdamW on the rank's shard,
  then the broadcast of every rank's updated shard);
* ``sync``: the broadcast alone (``_sync_params``, what ``step`` runs after its local step);

and, as references, a flat allreduce of the gradients' size (DDP's traffic each step), one
broadcast of each rank's shard as a single tensor, both at once (asynchronous, as zero1 issues
them), and the same two one after the other. Each block reads the node's link counters
(``/proc/net/dev`` in its namespace) before and after, so bytes a step are the kernel's count,
headers included. A timed call is the slowest rank's. After the blocks every variant's
parameters are compared with the first's: they must be equal (same gradients, same steps).

Variants: ``stock`` (torch's default, one broadcast per parameter) and ``bucket_view``
(``parameters_as_bucket_view=True``: one broadcast per rank's shard). ``overlap_with_ddp`` is not
a variant: it changes the training (its first steps do not update) and needs torch's DDP hooks.

Usage (root)::

    python -m benchmarks.testbed.zero1_broadcast --rate 1gbit --rounds 20
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path

from benchmarks.testbed.network import DEFAULT_MTU, Testbed
from benchmarks.testbed.node_jobs import node0_result, run_on_nodes
from benchmarks.testbed.rate import LinkRate, rate_argument

REPO = Path(__file__).resolve().parents[2]
VARIANTS = {"stock": False, "bucket_view": True}
_RESULT = "ZERO1_RESULT "


# --- on each node ------------------------------------------------------------------------------


def link_bytes(interface: str) -> tuple[int, int]:
    """Received and transmitted bytes of ``interface`` in this process's network namespace."""
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, fields = line.partition(":")
        if name.strip() == interface:
            values = fields.split()
            return int(values[0]), int(values[8])
    raise ValueError(f"no interface {interface!r} in /proc/net/dev")


def _timed_blocks(
    calls: dict[str, tuple[Callable[[], None], Callable[[], object]]],
    rounds: int,
    steps: int,
    interface: str,
) -> dict[str, dict[str, list[float]]]:
    """Every call's blocks of ``steps`` timed calls, in an order reversed each round (A B B A),
    each call the slowest rank's seconds; bytes a call from the link's counters, a block's mean.
    """
    import torch
    import torch.distributed as dist

    figures: dict[str, dict[str, list[float]]] = {
        key: {"seconds": [], "bytes": []} for key in calls
    }
    keys = list(calls)
    for round_index in range(rounds):
        for key in keys if round_index % 2 == 0 else keys[::-1]:
            prepare, call = calls[key]
            seconds = []
            dist.barrier()
            rx0, tx0 = link_bytes(interface)
            for _ in range(steps):
                prepare()
                dist.barrier()
                start = time.perf_counter()
                call()
                seconds.append(time.perf_counter() - start)
            rx1, tx1 = link_bytes(interface)
            slowest = torch.tensor(seconds, dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            figures[key]["seconds"].extend(slowest.tolist())
            # The barriers' few hundred bytes a call are in the count, as they are in a job's.
            figures[key]["bytes"].append((tx1 - tx0 + rx1 - rx0) / 2 / steps)
    return figures


def run_worker(args: argparse.Namespace) -> None:
    """One rank: every variant's blocks, interleaved; rank 0 prints the figures as JSON."""
    import torch
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer

    sys.path.insert(0, str(REPO / "examples"))
    from train_gpt import GPT

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    interface = os.environ["GLOO_SOCKET_IFNAME"]

    def build(bucket_view: bool) -> tuple[torch.nn.Module, ZeroRedundancyOptimizer]:
        torch.manual_seed(0)
        model = GPT(args.vocab, args.context, args.width, args.layers, 4)
        zero = ZeroRedundancyOptimizer(
            model.parameters(),
            optimizer_class=torch.optim.AdamW,
            parameters_as_bucket_view=bucket_view,
            lr=1e-3,
        )
        return model, zero

    built = {name: build(bucket_view) for name, bucket_view in VARIANTS.items()}
    parameters = list(built["stock"][0].parameters())
    gradient_numel = sum(p.numel() for p in parameters)
    flat = torch.zeros(gradient_numel)
    # The bucket view's own shards: the same partition, each its own buffer.
    shards = [bucket.clone() for bucket in built["bucket_view"][1]._buckets[0]]

    steps_taken = dict.fromkeys(VARIANTS, 0)

    def gradients_for(name: str) -> Callable[[], None]:
        """Set the variant's k-th gradients: the same for every variant's k-th step, and each
        rank its own, as DDP's before their allreduce (ZeRO steps each rank's shard)."""

        def set_gradients() -> None:
            generator = torch.Generator().manual_seed(1_000_003 * rank + steps_taken[name])
            steps_taken[name] += 1
            for p in built[name][0].parameters():
                p.grad = torch.randn(p.shape, generator=generator)

        return set_gradients

    def one_shard_each() -> None:
        handles = [dist.broadcast(s, src, async_op=True) for src, s in enumerate(shards)]
        for handle in handles:
            handle.wait()

    def one_shard_then_the_other() -> None:
        for src, tensor in enumerate(shards):
            dist.broadcast(tensor, src)

    calls: dict[str, tuple[Callable[[], None], Callable[[], object]]] = {}
    for name, (_, zero) in built.items():
        calls[f"step/{name}"] = (gradients_for(name), zero.step)
        calls[f"sync/{name}"] = (lambda: None, zero._sync_params)
    calls["ref/allreduce_gradients"] = (lambda: None, lambda: dist.all_reduce(flat))
    calls["ref/broadcast_one_shard_each"] = (lambda: None, one_shard_each)
    calls["ref/broadcast_shards_in_turn"] = (lambda: None, one_shard_then_the_other)
    figures = _timed_blocks(calls, args.rounds, args.steps, interface)
    reference = list(built["stock"][0].parameters())
    equal = {
        name: all(torch.equal(a, b) for a, b in zip(model.parameters(), reference, strict=True))
        for name, (model, _) in built.items()
    }
    if rank == 0:
        result = {
            "parameters": gradient_numel,
            "parameter_tensors": len(parameters),
            "figures": figures,
            "parameters_equal_to_stock": equal,
        }
        print(_RESULT + json.dumps(result), flush=True)
    dist.destroy_process_group()


# --- the driver --------------------------------------------------------------------------------


def _worker_command(args: argparse.Namespace) -> list[str]:
    return [
        sys.executable, "-m", "benchmarks.testbed.zero1_broadcast", "--worker",
        "--rounds", str(args.rounds), "--steps", str(args.steps), "--width", str(args.width),
        "--layers", str(args.layers), "--vocab", str(args.vocab), "--context", str(args.context),
    ]  # fmt: skip


def measure(args: argparse.Namespace) -> dict:
    """Bring up a 2-node testbed at ``args.rate``, run the workers, return rank 0's figures."""
    with Testbed(nodes=2, rate=args.rate) as bed:
        results = run_on_nodes(
            bed.nodes,
            lambda node: _worker_command(args),
            output_dir=args.output,
            timeout=600,
            env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
        )
    return node0_result(results, _RESULT)


def line_rate_seconds(payload_bytes: float, rate: LinkRate | None) -> float | None:
    """Seconds ``payload_bytes`` take at the link's TCP payload rate (None: unshaped)."""
    return None if rate is None else payload_bytes / rate.payload_bytes_per_second(DEFAULT_MTU)


def table(result: dict, rate: LinkRate | None) -> list[str]:
    """The Markdown table: median seconds (quartiles), bytes a rank a call, line-rate time."""
    shard_bytes = result["parameters"] * 4 / 2  # float32, two ranks
    lines = [
        "| call | seconds (median, quartiles) | link bytes a call (mean of rx, tx) "
        "| line-rate seconds of those bytes | of line rate |",
        "|---|---|---|---|---|",
    ]
    for key, figures in result["figures"].items():
        seconds = sorted(figures["seconds"])
        quartiles = statistics.quantiles(seconds, n=4)
        moved = statistics.mean(figures["bytes"])
        ideal = line_rate_seconds(moved, rate)
        share = "-" if ideal is None else f"{statistics.median(seconds) / ideal:.2f} x"
        lines.append(
            f"| {key} | {statistics.median(seconds):.4f} ({quartiles[0]:.4f}-{quartiles[2]:.4f}) "
            f"| {moved / 1e6:.2f} MB | {'-' if ideal is None else f'{ideal:.4f}'} | {share} |"
        )
    lines.append(
        f"\n{result['parameters']} parameters in {result['parameter_tensors']} tensors; a rank's "
        f"shard is about {shard_bytes / 1e6:.2f} MB; parameters equal to stock's after every "
        f"step: {result['parameters_equal_to_stock']}"
    )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """Measure, print the table, write the raw figures as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rate", type=rate_argument, default="1gbit", help="link rate")
    parser.add_argument("--rounds", type=int, default=20, help="interleaved blocks a call")
    parser.add_argument("--steps", type=int, default=5, help="timed calls a block")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--output", type=Path, default=Path("/tmp/distune-zero1-broadcast"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        run_worker(args)
        return 0
    rate = args.rate if not isinstance(args.rate, str) else LinkRate.parse(args.rate)
    args.rate = rate
    started = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    load_before = os.getloadavg()
    result = measure(args)
    load_after = os.getloadavg()
    print(
        f"{started}, 1/5/15-min load {'/'.join(f'{x:.2f}' for x in load_before)} before, "
        f"{'/'.join(f'{x:.2f}' for x in load_after)} after; link {rate or 'unshaped'}, 2 nodes x "
        f"1 rank, gloo; {args.rounds} rounds x {args.steps} calls a variant"
    )
    print("\n".join(table(result, rate)))
    args.output.mkdir(parents=True, exist_ok=True)
    result.update(
        started=started,
        load_before=load_before,
        load_after=load_after,
        rate=str(rate),
        rounds=args.rounds,
        steps=args.steps,
    )
    (args.output / "zero1_broadcast.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
