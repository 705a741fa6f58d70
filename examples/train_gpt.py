"""Train a small GPT-style language model on synthetic token streams with distune.

A decoder-only transformer (token and position embeddings, pre-norm causal self-attention
blocks built from ``torch.nn`` modules, a tied output head), a few million parameters. The data
is a fixed random Markov chain over the vocabulary, sampled on the fly, so there is something to
learn and nothing to download. Launch it like any torchrun script::

    distune-run --nproc_per_node 2 --autotune_level 1 examples/train_gpt.py --seconds 120

``--engine torch`` trains the same model under ``torch.nn.parallel.DistributedDataParallel`` at
its defaults instead, for a side-by-side comparison (launch it with torchrun or distune-run).
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import distune
from job import Budget, Progress, join, leave


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


def describe(ddp: nn.Module) -> str:
    """The communication settings in use, as the progress lines show them."""
    if isinstance(ddp, nn.parallel.DistributedDataParallel):
        return f"torch DDP, {ddp.bucket_bytes_cap / 2**20:g} MiB buckets, flat"
    return ddp.hyperparameters.describe()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=None, help="stop after this many steps")
    parser.add_argument("--seconds", type=float, default=None, help="stop after this long")
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--context", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--log-every", type=float, default=5.0, help="seconds between log lines")
    parser.add_argument(
        "--engine",
        choices=("distune", "torch"),
        default="distune",
        help="data-parallel wrapper: distune's (default) or torch's DDP at its defaults",
    )
    args = parser.parse_args()
    if args.steps is None and args.seconds is None:
        args.seconds = 120.0
    return args


def main() -> None:
    args = parse_args()
    job = join()
    torch.manual_seed(0)
    model = GPT(args.vocab, args.context, args.width, args.layers, args.heads).to(job.device)
    if args.engine == "torch":
        ddp = nn.parallel.DistributedDataParallel(model, device_ids=job.device_ids)
    else:
        ddp = distune.DistributedDataParallel(model, name="gpt", device_ids=job.device_ids)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=args.lr)
    text = MarkovText(args.vocab, job.device, seed=0, rank=job.rank)
    if job.rank == 0:
        count = sum(p.numel() for p in model.parameters())
        print(f"GPT with {count / 1e6:.2f}M parameters on {job.world_size} ranks", flush=True)

    budget = Budget(job, args.steps, args.seconds)
    progress = Progress(job, args.log_every)
    step = 0
    while not budget.exhausted(step):
        tokens = text.batch(args.batch_size, args.context)
        logits = ddp(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
        progress.step(step, loss, describe(ddp))
    progress.done(step, loss)
    leave()


if __name__ == "__main__":
    main()
