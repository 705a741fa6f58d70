"""Train a small GPT-style language model on synthetic token streams with distune.

A decoder-only transformer (token and position embeddings, pre-norm causal self-attention
blocks built from ``torch.nn`` modules, a tied output head), a few million parameters. The data
is a fixed random Markov chain over the vocabulary, sampled on the fly, so there is something to
learn and nothing to download. Launch it like any torchrun script::

    distune-run --nproc_per_node 2 --autotune_level 1 examples/train_gpt.py --seconds 120

It takes every knob through ``distune.prepare``: the model and optimizer it trains with, the
micro-batch and the accumulation steps. Without level 2 those are its own (``--batch-size``
sequences per rank per forward, ``--grad-accum`` forwards per optimizer step, distune's DDP,
tuned online at level 1). Level 2 tunes them, keeping the global batch (``--batch-size x
--grad-accum x ranks``) and splitting it differently, and also tries the ZeRO stages and
activation checkpointing::

    distune-run --nproc_per_node 2 --autotune_level 2 examples/train_gpt.py --steps 200 \
        --width 128 --context 32 --batch-size 2 --grad-accum 8

A config holding ``bf16: {enabled: auto}`` (``--autotune_config``) lets level 2 try bf16 mixed
precision too; without it the numerics are never changed.

``--engine torch`` trains the same model under ``torch.nn.parallel.DistributedDataParallel`` at
its defaults instead, for a side-by-side comparison (launch it with torchrun or distune-run;
nothing is tuned then).
"""

from __future__ import annotations

import argparse
import contextlib
from dataclasses import dataclass

import torch
from torch import nn

import distune
from job import Budget, Job, Progress, join, leave


class GPT(nn.Module):
    """A decoder-only transformer language model."""

    def __init__(self, vocab: int, context: int, width: int, layers: int, heads: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(context, width)
        block = nn.TransformerEncoderLayer(
            width,
            heads,
            4 * width,
            dropout=0.0,
            activation="gelu",
            batch_first=True,
            norm_first=True,
        )
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tokens.weight  # tied, as in GPT-2
        for embedding in (self.tokens, self.positions):
            nn.init.normal_(embedding.weight, std=0.02)  # GPT-2's scale keeps first logits small
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(context))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Next-token logits for every position of ``tokens`` (batch, time)."""
        length = tokens.shape[1]
        positions = torch.arange(length, device=tokens.device)
        hidden = self.tokens(tokens) + self.positions(positions)
        hidden = self.blocks(hidden, mask=self.causal[:length, :length], is_causal=True)
        return self.head(self.norm(hidden))


class MarkovText:
    """Token streams from a fixed random Markov chain: each token has a few likely successors."""

    def __init__(self, vocab: int, device: torch.device, seed: int, rank: int) -> None:
        chain = torch.Generator().manual_seed(seed)  # the same chain on every rank
        logits = torch.randn(vocab, vocab, generator=chain) * 4.0
        self.transitions = torch.softmax(logits, dim=1).to(device)
        self.generator = torch.Generator(device=device).manual_seed(seed + 1 + rank)
        self.vocab = vocab
        self.device = device

    def batch(self, size: int, length: int) -> torch.Tensor:
        """``size`` sequences of ``length + 1`` tokens."""
        tokens = torch.empty(size, length + 1, dtype=torch.long, device=self.device)
        tokens[:, 0] = torch.randint(
            self.vocab, (size,), generator=self.generator, device=self.device
        )
        for position in range(length):
            probabilities = self.transitions[tokens[:, position]]
            tokens[:, position + 1] = torch.multinomial(
                probabilities, 1, generator=self.generator
            ).squeeze(1)
        return tokens


@dataclass(frozen=True)
class Training:
    """What the loop trains with: the model and optimizer, and how a step splits its batch."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    micro_batch_size: int
    gradient_accumulation_steps: int
    strategy: str

    def accumulate(self, micro_step: int) -> contextlib.AbstractContextManager[None]:
        """Around micro-step ``micro_step``: gradients are averaged only in the last one."""
        if micro_step < self.gradient_accumulation_steps - 1:
            return self.model.no_sync()  # type: ignore[operator,no-any-return]
        return contextlib.nullcontext()

    def describe(self) -> str:
        """The settings in use, as the progress lines show them."""
        if isinstance(self.model, nn.parallel.DistributedDataParallel):
            return f"torch DDP, {self.model.bucket_bytes_cap / 2**20:g} MiB buckets, flat"
        if isinstance(self.model, distune.DistributedDataParallel):
            return f"{self.strategy}, {self.model.hyperparameters.describe()}"
        return self.strategy


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=None, help="stop after this many steps")
    parser.add_argument("--seconds", type=float, default=None, help="stop after this long")
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--context", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per rank per forward")
    parser.add_argument("--grad-accum", type=int, default=1, help="forwards per optimizer step")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=float, default=5.0, help="seconds between log lines")
    parser.add_argument(
        "--engine",
        choices=("distune", "torch"),
        default="distune",
        help="data-parallel wrapper: distune's through distune.prepare (default) or torch's DDP "
        "at its defaults",
    )
    args = parser.parse_args()
    if args.steps is None and args.seconds is None:
        args.seconds = 120.0
    return args


def wrap(args: argparse.Namespace, model: nn.Module, job: Job) -> Training:
    """The model and optimizer to train with: from ``distune.prepare``, or torch's DDP."""
    if args.engine == "torch":
        ddp = nn.parallel.DistributedDataParallel(model, device_ids=job.device_ids)
        optimizer = torch.optim.AdamW(ddp.parameters(), lr=args.lr)
        return Training(ddp, optimizer, args.batch_size, args.grad_accum, "torch DDP")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    run = distune.prepare(
        model,
        optimizer,
        micro_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum,
        name="gpt",
    )
    return Training(
        run.model,
        run.optimizer,
        run.micro_batch_size,
        run.gradient_accumulation_steps,
        run.strategy + (" + checkpointing" if run.activation_checkpointing else ""),
    )


def main() -> None:
    args = parse_args()
    job = join()
    torch.manual_seed(args.seed)
    model = GPT(args.vocab, args.context, args.width, args.layers, args.heads).to(job.device)
    count = sum(p.numel() for p in model.parameters())
    run = wrap(args, model, job)
    # Each rank draws its own stream of whole optimizer steps: the same samples whatever the
    # split into micro-batches, so every configuration trains the same model.
    text = MarkovText(args.vocab, job.device, seed=args.seed, rank=job.rank)
    per_step = run.micro_batch_size * run.gradient_accumulation_steps
    if job.rank == 0:
        print(
            f"GPT with {count / 1e6:.2f}M parameters on {job.world_size} ranks: {run.strategy}, "
            f"micro-batch {run.micro_batch_size} x {run.gradient_accumulation_steps}",
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
        loss = total
        progress.step(step, loss, run.describe())
    progress.done(step, loss)
    leave()


if __name__ == "__main__":
    main()
