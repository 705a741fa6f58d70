"""Fused against unfused optimizer step time on a model of many small parameters.

    python -m benchmarks.fused_optimizer --output /tmp/fused.json \
        --plot docs/images/bench_fused_optimizer.png

One process, variants interleaved round by round (so machine load hits them alike): torch's
optimizer as constructed by default (on CPU its per-parameter loop), the same with
``foreach=True`` (torch's multi-tensor path), and ``distune.fuse_optimizer`` of the default one.
For each of SGD (momentum), Adam and AdamW it times ``optimizer.step()`` alone (gradients in
place) and a whole training step (zero_grad, forward, backward, step), and reports medians and
ratios to the default.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import distune

OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "SGD(momentum)": lambda params, **kw: torch.optim.SGD(params, lr=0.01, momentum=0.9, **kw),
    "Adam": lambda params, **kw: torch.optim.Adam(params, lr=1e-3, **kw),
    "AdamW": lambda params, **kw: torch.optim.AdamW(params, lr=1e-3, **kw),
}
#: "fused+keep": fused, trained with ``zero_grad(set_to_none=False)``, so backward accumulates
#: straight into the flat gradient buffer and the step copies nothing.
VARIANTS = ("default", "foreach", "fused", "fused+keep")


def many_small_model(blocks: int, width: int) -> nn.Module:
    """``blocks`` x (Linear, LayerNorm): 4 parameters per block, ``width**2 + 3 width`` each."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(blocks):
        layers += [nn.Linear(width, width), nn.LayerNorm(width), nn.GELU()]
    return nn.Sequential(*layers)


def build(kind: str, variant: str, blocks: int, width: int) -> tuple[nn.Module, Any]:
    model = many_small_model(blocks, width)
    make = OPTIMIZERS[kind]
    if variant == "foreach":
        return model, make(model.parameters(), foreach=True)
    optimizer = make(model.parameters())
    return model, distune.fuse_optimizer(optimizer) if variant.startswith("fused") else optimizer


def time_variant(
    model: nn.Module, optimizer: Any, x: torch.Tensor, steps: int, set_to_none: bool
) -> tuple[list[float], list[float]]:
    """Seconds of each ``optimizer.step()`` alone, and of each whole training step."""
    step_only, whole = [], []
    for _ in range(steps):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=set_to_none)
        model(x).pow(2).mean().backward()
        middle = time.perf_counter()
        optimizer.step()
        end = time.perf_counter()
        step_only.append(end - middle)
        whole.append(end - start)
    return step_only, whole


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=150)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per round and variant")
    parser.add_argument("--output", type=Path, default=None, help="results as JSON")
    parser.add_argument("--plot", type=Path, default=None, help="bar chart (PNG)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    x = torch.randn(args.batch, args.width)
    built = {
        (kind, variant): build(kind, variant, args.blocks, args.width)
        for kind in OPTIMIZERS
        for variant in VARIANTS
    }
    samples: dict[tuple[str, str], tuple[list[float], list[float]]] = {
        key: ([], []) for key in built
    }
    for key, (model, optimizer) in built.items():  # warm up: state allocation, first calls
        time_variant(model, optimizer, x, 3, key[1] != "fused+keep")
    for _ in range(args.rounds):
        for key, (model, optimizer) in built.items():
            step_only, whole = time_variant(model, optimizer, x, args.steps, key[1] != "fused+keep")
            samples[key][0].extend(step_only)
            samples[key][1].extend(whole)
    n_params = sum(1 for _ in many_small_model(args.blocks, args.width).parameters())
    numel = sum(p.numel() for p in many_small_model(args.blocks, args.width).parameters())
    rows = []
    for kind in OPTIMIZERS:
        base_step = statistics.median(samples[(kind, "default")][0])
        base_whole = statistics.median(samples[(kind, "default")][1])
        for variant in VARIANTS:
            step = statistics.median(samples[(kind, variant)][0])
            whole = statistics.median(samples[(kind, variant)][1])
            rows.append(
                {
                    "optimizer": kind,
                    "variant": variant,
                    "step_ms": 1e3 * step,
                    "train_step_ms": 1e3 * whole,
                    "step_ratio": step / base_step,
                    "train_step_ratio": whole / base_whole,
                }
            )
    print(f"model: {n_params} parameters, {numel} elements; batch {args.batch}")
    print(f"{'optimizer':<14}{'variant':<9}{'step ms':>9}{'ratio':>7}{'train ms':>10}{'ratio':>7}")
    for r in rows:
        print(
            f"{r['optimizer']:<14}{r['variant']:<9}{r['step_ms']:>9.2f}{r['step_ratio']:>7.2f}"
            f"{r['train_step_ms']:>10.2f}{r['train_step_ratio']:>7.2f}"
        )
    if args.output:
        settings = {k: v for k, v in vars(args).items() if k not in ("output", "plot")}
        args.output.write_text(json.dumps({"args": settings, "rows": rows}, indent=1))
    if args.plot:
        plot(rows, args.plot, n_params)
    return 0


def plot(rows: list[dict[str, Any]], path: Path, n_params: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    kinds = list(OPTIMIZERS)
    width = 0.2
    for k, variant in enumerate(VARIANTS):
        values = [
            next(r["step_ms"] for r in rows if r["optimizer"] == kind and r["variant"] == variant)
            for kind in kinds
        ]
        ax.bar([i + (k - 1.5) * width for i in range(len(kinds))], values, width, label=variant)
    ax.set_xticks(range(len(kinds)), kinds)
    ax.set_ylabel("optimizer.step() ms (median)")
    ax.set_title(f"fused vs unfused optimizer step, {n_params} parameters (CPU)")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
