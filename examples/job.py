"""What every example does to take part in a job launched by ``distune-run`` (or torchrun).

It joins the process group on the backend that fits the hardware (NCCL on GPUs, gloo on CPU),
picks this rank's device, and stops all ranks at the same iteration when a step or time budget
runs out: a rank that stopped alone would leave the others waiting in an allreduce.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.distributed as dist

#: How often the ranks agree on whether the time budget is spent (one tiny allreduce).
_BUDGET_CHECK_EVERY = 10


@dataclass(frozen=True)
class Job:
    """This rank's place in the job."""

    rank: int
    world_size: int
    device: torch.device

    @property
    def device_ids(self) -> list[int] | None:
        """What DistributedDataParallel's ``device_ids`` should be on this device."""
        return [self.device.index] if self.device.type == "cuda" else None


def join() -> Job:
    """Initialise the default process group from torchrun's environment variables."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return Job(dist.get_rank(), dist.get_world_size(), device)


class Budget:
    """A step budget, a time budget, or both; every rank gets the same answer at each step."""

    def __init__(self, job: Job, steps: int | None, seconds: float | None) -> None:
        if steps is None and seconds is None:
            raise ValueError("give --steps, --seconds or both")
        self._job = job
        self._steps = steps
        self._seconds = seconds
        self._start = time.monotonic()

    def exhausted(self, step: int) -> bool:
        """Whether to stop before ``step`` (0-based); collective when a time budget is set."""
        if self._steps is not None and step >= self._steps:
            return True
        if self._seconds is None or step % _BUDGET_CHECK_EVERY:
            return False
        over = float(time.monotonic() - self._start >= self._seconds)
        flag = torch.tensor([over], device=self._job.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # rank clocks differ; agree on one answer
        return bool(flag.item())


class Progress:
    """Rank 0's log line every few seconds: step, loss, throughput since the last line, group."""

    def __init__(self, job: Job, every_seconds: float) -> None:
        self._enabled = job.rank == 0
        self._every = every_seconds
        self._last_time = time.monotonic()
        self._last_step = 0

    def step(self, step: int, loss: torch.Tensor, group: str) -> None:
        """Called after each step; prints when a line is due (reading the loss syncs)."""
        now = time.monotonic()
        if not self._enabled or now - self._last_time < self._every:
            return
        rate = (step - self._last_step) / (now - self._last_time)
        print(f"step {step} loss {loss.item():.4f} {rate:.2f} it/s ({group})", flush=True)
        self._last_time, self._last_step = now, step

    def done(self, step: int, loss: torch.Tensor) -> None:
        """The closing line."""
        if self._enabled:
            print(f"done: {step} steps, final loss {loss.item():.4f}", flush=True)


def leave() -> NoReturn:
    """Leave the process group and end this rank's process with exit status 0.

    Why not return and let Python exit: gloo's worker threads outlive ``destroy_process_group``
    (torch still holds the group once ``torch._dynamo`` is imported, as every optimizer does),
    and one of them may still be releasing the last collective's tensor when the interpreter
    starts finalizing. Releasing a tensor that Python has let go of takes the GIL, and a thread
    that asks for the GIL during finalization is ended from inside C++ code that cannot unwind:
    the process aborts ("terminate called without an active exception", pytorch/pytorch#190489)
    and torchrun reports the job failed. It ended one run in five to ten on a loaded 2-core machine,
    with torch's DDP as with distune's. A rank that has finished has nothing left to do, so it
    flushes its output and exits without finalizing the interpreter.
    """
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
