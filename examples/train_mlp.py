"""Train a small MLP on a synthetic regression task with distune: the embedded default job.

It needs nothing downloaded and runs on CPU (gloo) in seconds, or on GPUs (NCCL). Launch it like
any torchrun script, for example::

    distune-run --nproc_per_node 2 --autotune_level 1 examples/train_mlp.py --seconds 60

Each rank draws its own inputs; the targets come from a fixed random "teacher" network that every
rank builds from the same seed, so the loss falls as the model learns it.

It takes its batch as flags (``--batch-size`` samples per rank per forward, ``--grad-accum``
forwards per optimizer step, accumulated under ``no_sync``) and never calls the level-2 API:
it only wraps its model in ``distune.DistributedDataParallel``. Level 2 tunes its micro-batch
and accumulation through ``arg_mappings``, which rewrite those flags in each trial (the global
batch kept; strategies need ``distune.prepare``, as in ``train_gpt.py``). Give it a split with
room to move: at the defaults (32 x 1) the script's own split is already the largest
micro-batch, where level 2's search starts (docs/level2.md), so it measures that one and keeps
it::

    distune-run --nproc_per_node 2 --autotune_level 2 \
        --autotune_config examples/level2_arg_mappings.yaml \
        examples/train_mlp.py --batch-size 16 --grad-accum 2 --steps 300
"""

from __future__ import annotations

import argparse
import contextlib

import torch
from torch import nn

import distune
from job import Budget, Progress, join, leave


def make_mlp(width: int, depth: int, features: int) -> nn.Sequential:
    """``depth`` hidden layers of ``width`` units with ReLU, ``features`` in and out."""
    layers: list[nn.Module] = []
    size = features
    for _ in range(depth):
        layers += [nn.Linear(size, width), nn.ReLU()]
        size = width
    layers.append(nn.Linear(size, features))
    return nn.Sequential(*layers)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=None, help="stop after this many steps")
    parser.add_argument("--seconds", type=float, default=None, help="stop after this long")
    parser.add_argument("--width", type=int, default=1024, help="hidden units per layer")
    parser.add_argument("--depth", type=int, default=4, help="hidden layers")
    parser.add_argument("--features", type=int, default=256, help="input and output size")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per rank per forward")
    parser.add_argument("--grad-accum", type=int, default=1, help="forwards per optimizer step")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--log-every", type=float, default=5.0, help="seconds between log lines")
    args = parser.parse_args()
    if args.steps is None and args.seconds is None:
        args.seconds = 60.0
    return args


def main() -> None:
    args = parse_args()
    job = join()
    torch.manual_seed(0)  # the same teacher and initial weights everywhere
    teacher = make_mlp(args.width // 4, 2, args.features).to(job.device).requires_grad_(False)
    model = make_mlp(args.width, args.depth, args.features).to(job.device)
    ddp = distune.DistributedDataParallel(model, name="mlp", device_ids=job.device_ids)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    data = torch.Generator(device=job.device).manual_seed(1000 + job.rank)  # each rank its own

    budget = Budget(job, args.steps, args.seconds)
    progress = Progress(job, args.log_every)
    step = 0
    while not budget.exhausted(step):
        optimizer.zero_grad()
        for micro in range(args.grad_accum):
            # Gradients are averaged over the ranks in the last micro-step only.
            last = micro == args.grad_accum - 1
            with contextlib.nullcontext() if last else ddp.no_sync():
                inputs = torch.randn(
                    args.batch_size, args.features, generator=data, device=job.device
                )
                loss = nn.functional.mse_loss(ddp(inputs), teacher(inputs))
                (loss / args.grad_accum).backward()
        optimizer.step()
        step += 1
        progress.step(step, loss, ddp.hyperparameters.describe())
    progress.done(step, loss)
    leave()


if __name__ == "__main__":
    main()
