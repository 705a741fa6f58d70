"""A training script written for DDP: rank 0 alone saves the model's state dict mid-training.

Under ZeRO-2 or ZeRO-3 (FSDP) that state dict is a collective: the other ranks go on into the
next step's collectives, and without distune's check rank 0 would wait until the process
group's time-out. ``--checkpoint-timeout`` is passed to ``distune.prepare``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from level2_worker import Block  # the script's directory is on sys.path
from torch import nn

import distune


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--checkpoint-timeout", type=float, default=60.0)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), *(Block(32) for _ in range(3)), nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    run = distune.prepare(
        model,
        optimizer,
        micro_batch_size=4,
        blocks=(Block,),
        checkpoint_timeout=args.checkpoint_timeout,
    )
    print(f"rank {rank}: training under {run.strategy}", flush=True)
    for step in range(6):
        x = torch.randn(run.micro_batch_size, 8)
        run.model(x).square().mean().backward()
        run.optimizer.step()
        run.optimizer.zero_grad()
        if step == 2 and rank == 0:  # the DDP idiom: only rank 0 writes the checkpoint
            torch.save(run.model.state_dict(), args.out / "model.pt")
    print(f"rank {rank}: done", flush=True)
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # as examples/job.py's leave(): no interpreter finalization under gloo


if __name__ == "__main__":
    main()
