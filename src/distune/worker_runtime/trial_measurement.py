"""What a level-2 trial measures in every rank, and how it reports and ends.

A step is one optimizer step, timed from the end of the previous one to the end of this one, so
the time includes everything the loop does in between: loading data, forward, backward and
communication, as the user's job will. After ``warmup`` steps, ``measured`` steps are timed;
every rank takes each step's slowest rank, and the median gives the throughput (samples a
second over the job) with the spread of the steps. The peak memory is the highest of any rank.
Then every rank writes its part, rank 0 the result, and the trial's processes end.

A rank that fails writes why instead (:func:`install_failure_report`): ``oom`` for an
out-of-memory error of any allocator, ``crash`` with the tail of its traceback otherwise. The
launcher reads these files; it never guesses from a process's output.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from distune.worker_runtime.memory_cap import MemoryMeter

#: Rank 0's aggregated result; each rank's own file is ``rank<R>.json``.
RESULT_FILE = "result.json"
#: Each node's first rank rewrites this with the number of finished steps: that node
#: launcher's watchdog reads it.
PROGRESS_FILE = "progress"
_TRACEBACK_TAIL_LINES = 12
_OOM_MESSAGES = ("out of memory", "can't allocate memory", "DefaultCPUAllocator")


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` so that a reader sees the old file or the whole new one."""
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_text(json.dumps(data), encoding="utf-8")
    os.replace(partial, path)


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` (or what caused it) is an allocator running out of memory."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, torch.OutOfMemoryError | MemoryError) or any(
            text in str(seen) for text in _OOM_MESSAGES
        ):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def install_failure_report(trial_dir: Path, rank: int) -> None:
    """Make an uncaught exception in this rank write its outcome before the process ends."""
    previous = sys.excepthook

    def report(kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> None:
        lines = "".join(traceback.format_exception(kind, error, tb)).splitlines()
        outcome = "oom" if is_out_of_memory(error) else "crash"
        tail = "\n".join(lines[-_TRACEBACK_TAIL_LINES:])
        write_json(
            trial_dir / f"rank{rank}.json", {"rank": rank, "outcome": outcome, "error": tail}
        )
        previous(kind, error, tb)

    sys.excepthook = report


class TrialMeasurement:
    """Times optimizer steps of one rank, then reports and ends the trial's process."""

    def __init__(
        self,
        trial_dir: Path,
        meter: MemoryMeter,
        samples_per_step: int,
        micro_batch: int,
        warmup: int,
        measured: int,
        device: torch.device,
        describe: Callable[[], dict[str, Any]],
    ) -> None:
        self.trial_dir = trial_dir
        self.meter = meter
        self.samples_per_step = samples_per_step
        self.micro_batch = micro_batch
        self.warmup = warmup
        self.measured = measured
        self.device = device
        self.rank = dist.get_rank()
        self._writes_progress = int(os.environ.get("LOCAL_RANK", self.rank)) == 0
        self._describe = describe
        self._steps = 0
        self._last = time.perf_counter()
        self._durations: list[float] = []
        self._forward_start = 0
        self._activation_bytes = 0
        # Per forward: what the repeated blocks kept, their inputs, the largest block's share.
        self._block_start: dict[int, int] = {}
        self._blocks_kept = self._blocks_input = self._block_max = 0
        self._checkpointed_bytes = 0

    def attach(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        blocks: tuple[type[nn.Module], ...] = (),
    ) -> None:
        """Time ``optimizer``'s steps and watch ``model``'s forwards (activation bytes), and
        its repeated ``blocks``' (what checkpointing them would keep instead)."""
        optimizer.register_step_post_hook(self._after_step)
        model.register_forward_pre_hook(self._before_forward)
        model.register_forward_hook(self._after_forward)
        for module in model.modules():
            if isinstance(module, blocks):
                module.register_forward_pre_hook(self._before_block)
                module.register_forward_hook(self._after_block)
        (self.trial_dir / f"pid.{self.rank}").write_text(str(os.getpid()), encoding="utf-8")

    def _before_forward(self, *_: Any) -> None:
        self._forward_start = self.meter.live_bytes()
        self._blocks_kept = self._blocks_input = self._block_max = 0

    def _after_forward(self, *_: Any) -> None:
        # What the forward left alive is what autograd saved for backward: the activations.
        kept = self.meter.live_bytes() - self._forward_start
        self._activation_bytes = max(self._activation_bytes, kept)
        # Checkpointed blocks keep only their inputs, and recompute one block at a time.
        checkpointed = kept - self._blocks_kept + self._blocks_input + self._block_max
        self._checkpointed_bytes = max(self._checkpointed_bytes, checkpointed)

    def _before_block(self, module: nn.Module, inputs: tuple[Any, ...]) -> None:
        self._block_start[id(module)] = self.meter.live_bytes()

    def _after_block(self, module: nn.Module, inputs: tuple[Any, ...], _output: Any) -> None:
        kept = self.meter.live_bytes() - self._block_start.pop(id(module), 0)
        self._blocks_kept += kept
        self._block_max = max(self._block_max, kept)
        self._blocks_input += sum(
            t.numel() * t.element_size() for t in inputs if isinstance(t, torch.Tensor)
        )

    def _after_step(self, *_: Any) -> None:
        now = time.perf_counter()
        self._steps += 1
        if self._steps > self.warmup:
            self._durations.append(now - self._last)
        elif self._steps == self.warmup:
            self.meter.reset_peak()
        self._last = now
        if self._writes_progress:
            write_json(self.trial_dir / PROGRESS_FILE, {"steps": self._steps})
        if self._steps == self.warmup + self.measured:
            self._finish()

    def _max_over_ranks(self, values: list[float]) -> list[float]:
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return tensor.tolist()

    def _finish(self) -> None:
        local_peak = self.meter.peak_bytes()
        durations = self._max_over_ranks(self._durations)
        peak, activation, checkpointed = self._max_over_ranks(
            [float(local_peak), float(self._activation_bytes), float(self._checkpointed_bytes)]
        )
        step = statistics.median(durations)
        rates = sorted(self.samples_per_step / d for d in durations)
        quartiles = statistics.quantiles(rates, n=4) if len(rates) >= 2 else [rates[0]] * 3
        write_json(
            self.trial_dir / f"rank{self.rank}.json",
            {"rank": self.rank, "outcome": "ok", "peak_memory_bytes": local_peak},
        )
        if self.rank == 0:
            result = {
                "outcome": "ok",
                "throughput": self.samples_per_step / step,
                "throughput_spread": (quartiles[2] - quartiles[0]) / (self.samples_per_step / step),
                "step_seconds": step,
                "step_seconds_all": durations,
                "peak_memory_bytes": int(peak),
                "activation_bytes_per_sample": int(activation / self.micro_batch),
                "checkpointed_activation_bytes_per_sample": int(checkpointed / self.micro_batch),
                **self._describe(),
            }
            write_json(self.trial_dir / RESULT_FILE, result)
        dist.barrier()
        dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        # The trial is over: the script's remaining loop must not run (see examples/job.py on
        # why a rank ends without finalizing the interpreter).
        os._exit(0)
