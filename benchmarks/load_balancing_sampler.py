"""Load-balanced sampler against ``DistributedSampler``: step time on variable-length samples.

    python -m benchmarks.load_balancing_sampler --output /tmp/sampler.json

Two gloo ranks on this machine train ``distune.DistributedDataParallel`` on packed sequences of
log-normal lengths (as sentence lengths are): every token of a batch goes through the same MLP,
so a batch costs its total token count, and each step waits at the gradient allreduce for the
rank with the most tokens. The two samplers alternate, a block of steps each, round by round in
the same processes (machine load hits both alike). Reported: mean step time, the mean over
steps of the slowest rank's tokens over the mean rank's, and the mean tokens a rank processes
per step (the same work for both samplers, so step times compare).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import distune
from tests.support.local_host import free_port


class Sequences(Dataset[torch.Tensor]):
    """``n`` token sequences of log-normal lengths (median ``e**4``, about 55 tokens)."""

    def __init__(self, n: int, vocab: int, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        lengths = torch.empty(n).log_normal_(4.0, 0.8, generator=generator).ceil().long()
        self.sequences = [torch.randint(vocab, (int(k),), generator=generator) for k in lengths]

    def __len__(self) -> int:
        return len(self.sequences)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.sequences[index]


def pack(batch: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens of the batch back to back, and each token's sample index (no padding)."""
    owners = torch.cat([torch.full((len(s),), i) for i, s in enumerate(batch)])
    return torch.cat(batch), owners


class TokenModel(nn.Module):
    """Embedding, a per-token MLP (the cost), a per-sample mean, a classifier."""

    def __init__(self, vocab: int, width: int, hidden: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.mlp = nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))
        self.head = nn.Linear(width, 8)

    def forward(self, tokens: torch.Tensor, owners: torch.Tensor, samples: int) -> torch.Tensor:
        h = self.mlp(self.embed(tokens))
        pooled = torch.zeros(samples, h.shape[1]).index_add_(0, owners, h)
        counts = torch.bincount(owners, minlength=samples).clamp_(min=1)
        return self.head(pooled / counts[:, None])


def _rank_main(rank: int, args: argparse.Namespace, port: int, out: Path) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks)
    dataset = Sequences(args.samples, args.vocab)
    torch.manual_seed(0)
    model = distune.DistributedDataParallel(TokenModel(args.vocab, args.width, args.hidden))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    samplers = {
        "DistributedSampler": DistributedSampler(dataset, seed=1),
        "LoadBalancingDistributedSampler": distune.data.LoadBalancingDistributedSampler(
            dataset, len, seed=1
        ),
    }
    times: dict[str, list[float]] = {name: [] for name in samplers}
    imbalance: dict[str, list[float]] = {name: [] for name in samplers}
    work: dict[str, list[float]] = {name: [] for name in samplers}
    for round_ in range(args.rounds):
        for name, sampler in samplers.items():
            sampler.set_epoch(round_)
            loader = DataLoader(dataset, args.batch, sampler=sampler, collate_fn=pack)
            for step, (tokens, owners) in enumerate(loader):
                if step == args.steps:
                    break
                counts = torch.tensor([float(len(tokens))])
                gathered = [torch.zeros(1) for _ in range(args.ranks)]
                dist.all_gather(gathered, counts)  # outside the timed part
                dist.barrier()
                start = time.perf_counter()
                optimizer.zero_grad()
                logits = model(tokens, owners, args.batch)
                loss = logits.logsumexp(dim=1).mean()
                loss.backward()
                optimizer.step()
                elapsed = time.perf_counter() - start
                if step >= 2:  # the first steps of a block pay for the loader's start
                    times[name].append(elapsed)
                    tokens_per_rank = [float(g) for g in gathered]
                    imbalance[name].append(
                        max(tokens_per_rank) / statistics.mean(tokens_per_rank) - 1
                    )
                    work[name].append(statistics.mean(tokens_per_rank))
    if rank == 0:
        result = {"times": times, "imbalance": imbalance, "work": work}
        (out / "result.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=25, help="steps per block")
    parser.add_argument("--output", type=Path, default=None, help="results as JSON")
    args = parser.parse_args(argv)
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"distune-sampler-bench-{os.getpid()}"
    out.mkdir(parents=True, exist_ok=True)
    mp.spawn(_rank_main, args=(args, free_port(), out), nprocs=args.ranks)
    raw = json.loads((out / "result.json").read_text())
    rows: dict[str, Any] = {}
    for name, times in raw["times"].items():
        rows[name] = {
            "mean_step_ms": 1e3 * statistics.mean(times),
            "median_step_ms": 1e3 * statistics.median(times),
            "steps": len(times),
            "mean_token_imbalance": statistics.mean(raw["imbalance"][name]),
            # The same work on both sides: tokens per rank per step, on average.
            "mean_tokens_per_rank": statistics.mean(raw["work"][name]),
        }
    base = rows["DistributedSampler"]["mean_step_ms"]
    for row in rows.values():
        row["step_ratio"] = row["mean_step_ms"] / base
    print(f"{args.ranks} ranks, batch {args.batch}, {args.samples} samples")
    for name, row in rows.items():
        print(
            f"{name:<32} mean step {row['mean_step_ms']:7.1f} ms (x{row['step_ratio']:.3f}), "
            f"median {row['median_step_ms']:7.1f} ms, slowest rank's tokens "
            f"+{100 * row['mean_token_imbalance']:.1f}% over the mean "
            f"(mean {row['mean_tokens_per_rank']:.0f} tokens a rank)"
        )
    if args.output:
        args.output.write_text(json.dumps({"args": vars(args) | {"output": None}, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
