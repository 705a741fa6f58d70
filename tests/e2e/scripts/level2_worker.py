"""A small level-2 training script whose trials can be made to fail on purpose.

A residual MLP trained through ``distune.prepare`` on synthetic data. ``--oom-rank R
--oom-from-micro M`` makes rank R alone allocate past the device memory cap when the micro-batch
is at least M (a real ``torch.OutOfMemoryError`` from the cap); ``--crash-stage S`` raises in
the loop under ZeRO stage S; ``--hang`` never finishes a step. Prints its configuration once.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import distune


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--grad-accum", type=int, default=4)
    parser.add_argument("--oom-rank", type=int, default=None)
    parser.add_argument("--oom-from-micro", type=int, default=None)
    parser.add_argument("--crash-stage", type=int, default=None)
    parser.add_argument("--hang", action="store_true")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), *(Block(64) for _ in range(3)), nn.Linear(64, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    run = distune.prepare(
        model,
        optimizer,
        micro_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum,
    )
    if rank == 0:
        print(
            f"config: {run.strategy} {run.micro_batch_size} x {run.gradient_accumulation_steps}",
            flush=True,
        )
    stage = int(run.strategy[-1]) if run.strategy.startswith("zero") else 0
    data = torch.Generator().manual_seed(rank)
    for _ in range(args.steps):
        if args.hang:
            time.sleep(3600)
        if stage == args.crash_stage:
            raise ValueError(f"deliberate failure under {run.strategy}")
        if rank == args.oom_rank and run.micro_batch_size >= (args.oom_from_micro or 0):
            assert run.memory is not None
            torch.empty(run.memory.live_bytes() + 64 * 2**20, dtype=torch.uint8)  # over the cap
        for micro in range(run.gradient_accumulation_steps):
            x = torch.randn(run.micro_batch_size, 16, generator=data)
            with run.accumulate(micro):
                loss = run.model(x).pow(2).mean() / run.gradient_accumulation_steps
                loss.backward()
        run.optimizer.step()
        run.optimizer.zero_grad()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # as examples/job.py's leave() (pytorch/pytorch#190489)


if __name__ == "__main__":
    main()
