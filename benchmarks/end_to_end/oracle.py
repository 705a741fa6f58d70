"""The oracle session: every rank of a testbed job measures every variant, interleaved.

Run under torchrun on every node of the testbed (the driver, ``python -m benchmarks.end_to_end``,
does that). The GPT example's model (``examples/train_gpt.py`` at its defaults: its model, data,
AdamW) is wrapped three times, from the same initial weights:

* ``compute``: no wrapper, no communication: the compute-only step, with all ranks running;
* ``torch``: ``torch.nn.parallel.DistributedDataParallel`` at its defaults (25 MiB buckets);
* ``distune``: distune's ``DistributedDataParallel``, switched with ``set_hyperparameters`` to
  every group of its search space in turn (one variant per group).

Each round visits every variant once, in a shuffled order (the same on every rank, a new one
each round), so whatever else loads the machine hits all variants alike. A visit switches to
the variant, runs ``--warmup-steps`` untimed steps (bucket rebuilds, allocator), then times
``--steps`` steps, all ranks starting together; its time is the slowest rank's. Rank 0 writes
every visit to ``--output`` (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import distune
from distune.space import Hyperparameters, ModelFacts, SearchSpace

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from job import leave
from train_gpt import GPT, MarkovText  # the example is a script, not a package

COMPUTE, TORCH = "compute", "torch"


def group_variant(hp: Hyperparameters) -> str:
    """The variant name of one of distune's groups, e.g. ``distune:2^20:hier``."""
    return f"distune:2^{hp.bucket_size_2p}:{'hier' if hp.is_hierarchical_reduce else 'flat'}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=4, help="visits of every variant")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per visit")
    parser.add_argument("--warmup-steps", type=int, default=2, help="untimed steps per visit")
    parser.add_argument("--seed", type=int, default=0, help="seeds the visiting order")
    parser.add_argument("--output", type=Path, required=True, help="JSON written by rank 0")
    # The example's defaults (examples/train_gpt.py).
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    load_before = os.getloadavg()

    def model() -> nn.Module:
        torch.manual_seed(0)  # the same initial weights for every variant
        return GPT(args.vocab, args.context, args.width, args.layers, args.heads)

    models: dict[str, nn.Module] = {
        COMPUTE: model(),
        TORCH: nn.parallel.DistributedDataParallel(model()),
    }
    ours = distune.DistributedDataParallel(model(), name="gpt")
    models["distune"] = ours
    gradient_bytes = sum(p.numel() * p.element_size() for p in ours.parameters())
    topology = ours.topology
    facts = ModelFacts(
        topology.world_size, topology.nnodes, topology.local_world_size, gradient_bytes
    )
    space = SearchSpace.for_model(facts)
    optimizers = {k: torch.optim.AdamW(m.parameters(), lr=args.lr) for k, m in models.items()}
    text = MarkovText(args.vocab, torch.device("cpu"), seed=0, rank=rank)

    def step(name: str) -> None:
        tokens = text.batch(args.batch_size, args.context)
        logits = models[name](tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        optimizers[name].zero_grad()
        loss.backward()
        optimizers[name].step()

    switches: dict[str, tuple[str, Callable[[], None]]] = {
        COMPUTE: (COMPUTE, lambda: None),
        TORCH: (TORCH, lambda: None),
    }
    for hp in space:
        switches[group_variant(hp)] = ("distune", lambda hp=hp: ours.set_hyperparameters(hp))

    visits = []
    for round_ in range(args.rounds):
        order = list(switches)
        random.Random(args.seed * 1000 + round_).shuffle(order)  # the same order on every rank
        for variant in order:
            wrapper, switch = switches[variant]
            switch()
            for _ in range(args.warmup_steps):
                step(wrapper)
            dist.barrier()  # every rank starts the timed steps together
            began = time.perf_counter()
            for _ in range(args.steps):
                step(wrapper)
            elapsed = torch.tensor([time.perf_counter() - began], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's time
            visits.append(
                {
                    "variant": variant,
                    "round": round_,
                    "steps": args.steps,
                    "seconds": float(elapsed.item()),
                }
            )
    if rank == 0:
        groups = {group_variant(hp): hp.to_dict() for hp in space}
        result = {
            "started": started_at,
            "finished": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
            "torch": torch.__version__,
            "facts": asdict(facts),
            "default_group": group_variant(space.default),
            "groups": groups,
            "model": vars(args) | {"output": str(args.output)},
            "visits": visits,
        }
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(result, indent=1) + "\n")
    leave()  # not through interpreter finalization: see examples/job.py


if __name__ == "__main__":
    main()
