"""A deterministic training job whose final parameters are written out, for fault injection.

Every rank trains the same small MLP for exactly ``--steps`` steps on inputs drawn from a
per-rank seeded generator, on one CPU thread, so two runs with the same arguments end with the
same parameters, bit for bit, whatever happened to the tuning service meanwhile. (With two
ranks, each averaged gradient element is ``(a + b) / 2`` whatever the bucket size, because
floating-point addition of two numbers is commutative: the group schedule cannot change the
result either. Each benchmark invocation checks that claim by comparing a tuned run with an
untuned one.)

Files written to ``--out`` (created if missing):

* ``pid.rank<R>.attempt<A>``: this worker's pid, written at start, so an injector can kill it;
* ``rank<R>.attempt<A>.json`` at the end: steps trained, the SHA-256 of the parameters, and the
  groups the model ran with (the step at which each began);
* ``rank<R>.params.pt``: the parameters themselves, for a closer look at a mismatch.

``--sleep`` adds a pause per step: the job lasts long enough to be tuned while keeping the CPU
free for the other ranks and the service. ``--service-token`` replaces the token the launcher
gave the workers (to test what a wrong token does).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import distune
from job import join, leave


def parameters_digest(module: nn.Module) -> str:
    """SHA-256 over every parameter's bytes, in ``named_parameters`` order."""
    digest = hashlib.sha256()
    for name, parameter in module.named_parameters():
        digest.update(name.encode())
        digest.update(parameter.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, required=True, help="steps to train")
    parser.add_argument("--out", type=Path, required=True, help="directory for the results")
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds of pause per step")
    parser.add_argument("--width", type=int, default=256, help="hidden units per layer")
    parser.add_argument("--depth", type=int, default=3, help="hidden layers")
    parser.add_argument("--service-token", default=None, help="use this token instead")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)  # one thread: the same kernels, the same summation order
    if args.service_token is not None:
        os.environ["DISTUNE_SERVICE_TOKEN"] = args.service_token
    job = join()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    args.out.mkdir(parents=True, exist_ok=True)
    tag = f"rank{job.rank}.attempt{attempt}"
    (args.out / f"pid.{tag}").write_text(str(os.getpid()))

    torch.manual_seed(0)
    layers: list[nn.Module] = []
    size = 64
    for _ in range(args.depth):
        layers += [nn.Linear(size, args.width), nn.ReLU()]
        size = args.width
    model = nn.Sequential(*layers, nn.Linear(size, 64))
    ddp = distune.DistributedDataParallel(model, name="faults")
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    data = torch.Generator().manual_seed(1000 + job.rank)
    teacher = torch.Generator().manual_seed(7)
    target_map = torch.randn(64, 64, generator=teacher)

    groups: list[tuple[int, str]] = []
    for step in range(args.steps):
        current = ddp.hyperparameters.describe()
        if not groups or groups[-1][1] != current:
            groups.append((step, current))
        inputs = torch.randn(32, 64, generator=data)
        loss = nn.functional.mse_loss(ddp(inputs), inputs @ target_map)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if args.sleep:
            time.sleep(args.sleep)

    torch.save(
        {k: v.detach().clone() for k, v in model.state_dict().items()},
        args.out / f"rank{job.rank}.params.pt",
    )
    result = {
        "rank": job.rank,
        "attempt": attempt,
        "steps": args.steps,
        "sha256": parameters_digest(model),
        "groups": groups,
        "final_loss": loss.item(),
    }
    (args.out / f"{tag}.json").write_text(json.dumps(result))
    if job.rank == 0:
        print(f"worker done: {args.steps} steps, sha256 {result['sha256'][:16]}", flush=True)
    leave()


if __name__ == "__main__":
    main()
