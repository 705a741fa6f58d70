"""Per-window throughput: iterations done and wall-clock seconds they took on this rank."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Window:
    """``iterations`` training iterations that took ``seconds`` on this rank."""

    iterations: int
    seconds: float


class WindowMeter:
    """Measures the windows between sync points.

    On CUDA the clock is read only after the device has finished the work queued so far, so a
    window's seconds never run ahead of the GPU (kernels are asynchronous: without the
    synchronisation, the host would time how fast it enqueues, not how fast the GPU trains).
    It costs one device synchronisation per window, about once a second.
    """

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._start_time = 0.0
        self._start_iteration: int | None = None

    def _now(self) -> float:
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        return time.perf_counter()

    @property
    def started(self) -> bool:
        """Whether a window is open."""
        return self._start_iteration is not None

    def start(self, iteration: int) -> None:
        """Open a window at the end of iteration ``iteration``."""
        self._start_time = self._now()
        self._start_iteration = iteration

    def stop(self, iteration: int) -> Window:
        """Close the window at the end of iteration ``iteration`` and return it."""
        if self._start_iteration is None:
            raise RuntimeError("no window is open")
        seconds = self._now() - self._start_time
        window = Window(iteration - self._start_iteration, seconds)
        self._start_iteration = None
        return window
