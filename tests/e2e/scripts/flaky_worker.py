"""A worker that trains a tiny model and fails on purpose, for the launcher's failure paths.

``--fail-attempts N`` makes rank 1 fail after a few steps, with exit code ``FAILURE_EXIT_CODE``,
while ``TORCHELASTIC_RESTART_COUNT`` is below N (so ``--max_restarts`` can recover); without it
every attempt succeeds. ``--seconds`` is the training time of a successful attempt.
"""

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "examples"))

import distune
from job import Budget, join, leave

#: The failing rank's exit code: distinct from Python's 1 so a test sees it passed through.
FAILURE_EXIT_CODE = 3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fail-attempts", type=int, default=0)
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()
    job = join()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 64))
    ddp = distune.DistributedDataParallel(model, name="flaky")
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    budget = Budget(job, None, args.seconds)
    step = 0
    while not budget.exhausted(step):
        if attempt < args.fail_attempts and dist.get_rank() == 1 and step == 20:
            # Not by raising: on torch 2.13 a process that finalizes the interpreter with
            # gloo threads alive may abort (exit 134) instead of exiting 1, as examples/job.py's
            # leave() explains, and the test checks the launcher passes the worker's code on.
            print(f"injected failure on attempt {attempt}", file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(FAILURE_EXIT_CODE)
        loss = ddp(torch.randn(16, 64)).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
    print(
        f"rank {job.rank} attempt {attempt} finished {step} steps at {time.time():.0f}", flush=True
    )
    leave()


if __name__ == "__main__":
    main()
