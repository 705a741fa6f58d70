"""Train the GPT example through ``distune.prepare``, so level 2 can tune its batch and memory
knobs: micro-batch per rank, gradient accumulation, ZeRO stage and activation checkpointing.

The global batch is ``--batch-size x --grad-accum x ranks``; level 2 keeps it and splits it
differently. Launch it like any torchrun script::

    distune-run --nproc_per_node 2 --autotune_level 2 examples/tune_gpt.py --steps 200

Without level 2 it trains with its own settings on distune's DDP.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import distune
from job import Budget, Progress, join, leave
from train_gpt import GPT, MarkovText


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=None, help="stop after this many steps")
    parser.add_argument("--seconds", type=float, default=None, help="stop after this long")
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--context", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=2, help="sequences per rank per forward")
    parser.add_argument("--grad-accum", type=int, default=4, help="forwards per optimizer step")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=float, default=5.0, help="seconds between log lines")
    args = parser.parse_args()
    if args.steps is None and args.seconds is None:
        args.seconds = 120.0
    return args


def main() -> None:
    args = parse_args()
    job = join()
    torch.manual_seed(args.seed)
    model = GPT(args.vocab, args.context, args.width, args.layers, args.heads).to(job.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    count = sum(p.numel() for p in model.parameters())
    run = distune.prepare(
        model,
        optimizer,
        micro_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum,
        name="gpt",
    )
    # Each rank draws its own stream of whole optimizer steps: the same samples whatever the
    # split into micro-batches, so every configuration trains the same model.
    text = MarkovText(args.vocab, job.device, seed=args.seed, rank=job.rank)
    per_step = run.micro_batch_size * run.gradient_accumulation_steps
    if job.rank == 0:
        print(
            f"GPT with {count / 1e6:.2f}M parameters on {job.world_size} ranks: {run.strategy}, "
            f"micro-batch {run.micro_batch_size} x {run.gradient_accumulation_steps}"
            f"{', activation checkpointing' if run.activation_checkpointing else ''}",
            flush=True,
        )
    budget = Budget(job, args.steps, args.seconds)
    progress = Progress(job, args.log_every)
    step = 0
    loss = torch.zeros(())
    while not budget.exhausted(step):
        tokens = text.batch(per_step, args.context)
        total = torch.zeros((), device=job.device)
        for micro, chunk in enumerate(tokens.split(run.micro_batch_size)):
            with run.accumulate(micro):
                logits = run.model(chunk[:, :-1])
                loss = nn.functional.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten())
                (loss / run.gradient_accumulation_steps).backward()
            total += loss.detach() / run.gradient_accumulation_steps
        run.optimizer.step()
        run.optimizer.zero_grad()
        step += 1
        progress.step(step, total, run.strategy)
        loss = total
    progress.done(step, loss)
    leave()


if __name__ == "__main__":
    main()
