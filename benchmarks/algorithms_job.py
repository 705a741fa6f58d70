"""The worker of ``benchmarks/algorithms.py``: every algorithm, side by side, in one job.

Run by torchrun on every node of the testbed (``python benchmarks/algorithms_job.py --output
DIR``). Each rank trains a student MLP to imitate a fixed random teacher on its own data stream;
round by round, every variant trains a fresh copy (same initial weights, same data) for the same
number of steps. Per variant and round: the step time (the slowest rank's, the block's wall time
over its steps), and the loss on a held-out batch after the steps (averaged over the ranks' models,
which differ under model averaging).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import distune
from distune import algorithms


def student(width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(width, 2 * width),
        nn.ReLU(),
        nn.Linear(2 * width, 2 * width),
        nn.ReLU(),
        nn.Linear(2 * width, width // 2),
        nn.ReLU(),
        nn.Linear(width // 2, 1),
    )


def teacher(width: int) -> nn.Module:
    torch.manual_seed(123)
    return nn.Sequential(nn.Linear(width, 64), nn.Tanh(), nn.Linear(64, 1))


def _distune(algorithm: Any) -> Callable[[nn.Module], nn.Module]:
    return lambda module: distune.DistributedDataParallel(module, algorithm=algorithm)


def _distune_hook(module: nn.Module) -> nn.Module:
    model = distune.DistributedDataParallel(module)
    model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    return model


VARIANTS: dict[str, Callable[[nn.Module], nn.Module]] = {
    "torch DDP": lambda module: nn.parallel.DistributedDataParallel(module),
    "GradientAllReduce": _distune(algorithms.GradientAllReduce()),
    "LowPrecision(8 bit)": _distune(algorithms.LowPrecision(bits=8)),
    "LowPrecision(8 bit, flat)": _distune(algorithms.LowPrecision(bits=8, hierarchical=False)),
    "LowPrecision(fp16)": _distune(algorithms.LowPrecision(bits=16, dtype="fp16")),
    "torch fp16_compress_hook": _distune_hook,
    "Decentralized(ring)": _distune(algorithms.Decentralized("ring")),
    "Decentralized(shift_one)": _distune(algorithms.Decentralized("shift_one")),
    "Decentralized(ring, interval 4)": _distune(algorithms.Decentralized("ring", interval=4)),
    "AsyncModelAverage(0.5 s)": _distune(algorithms.AsyncModelAverage(0.5)),
}


def batch(width: int, size: int, seed: int, target: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(size, width, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return x, target(x)


def run_variant(
    name: str, args: argparse.Namespace, target: nn.Module, held_out: tuple[torch.Tensor, ...]
) -> dict[str, float]:
    rank = dist.get_rank()
    model = VARIANTS[name](student(args.width))
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    def step(i: int) -> None:
        x, y = batch(args.width, args.batch, 10_000 * rank + i, target)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()

    for i in range(args.warmup):
        step(i)
    dist.barrier()
    start = time.perf_counter()
    for i in range(args.warmup, args.warmup + args.steps):
        step(i)
    elapsed = torch.tensor([time.perf_counter() - start])
    if hasattr(model, "finish"):
        model.finish()  # model averaging: the last average (not timed: once per training)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    with torch.no_grad():
        loss = torch.tensor([nn.functional.mse_loss(model(held_out[0]), held_out[1]).item()])
    dist.all_reduce(loss)
    return {"step_s": float(elapsed) / args.steps, "loss": float(loss) / dist.get_world_size()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS))
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    target = teacher(args.width)
    held_out = batch(args.width, 512, 999_999, target)
    results: dict[str, list[dict[str, float]]] = {name: [] for name in args.variants}
    for round_ in range(args.rounds):
        for name in args.variants:
            results[name].append(run_variant(name, args, target, held_out))
            if dist.get_rank() == 0:
                print(f"round {round_} {name}: {results[name][-1]}", flush=True)
    if dist.get_rank() == 0:
        params = sum(p.numel() for p in student(args.width).parameters())
        args.output.mkdir(parents=True, exist_ok=True)
        (args.output / "algorithms.json").write_text(
            json.dumps(
                {
                    "world_size": dist.get_world_size(),
                    "parameters": params,
                    "gradient_bytes": 4 * params,
                    "args": {k: str(v) for k, v in vars(args).items()},
                    "results": results,
                },
                indent=1,
            )
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
