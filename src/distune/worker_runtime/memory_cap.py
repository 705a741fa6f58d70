"""A rank's tensor memory: its peak, and a cap that makes out-of-memory real on any machine.

On CPU there is no allocator to ask, so :class:`LiveTensorBytes` counts it: a
``TorchDispatchMode`` sees every operator's outputs and adds the bytes of each storage it has
not seen, and a weak reference to the storage subtracts them when it is freed. FSDP frees and
re-allocates parameter storages by resizing them in place, which no dispatch mode sees, so
``UntypedStorage.resize_`` is wrapped while the count runs (as torch's own ``MemTracker`` does).
When an operator takes the live bytes over the cap, it raises ``torch.OutOfMemoryError``, the
error a GPU raises, and the job's out-of-memory path runs as it would on a full card.

On CUDA the device's allocator is asked instead (:class:`CudaMemory`), and a cap is
``torch.cuda.set_per_process_memory_fraction``, emulating a smaller card.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterable
from typing import Any, Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary


class MemoryMeter(Protocol):
    """What a trial reads of a rank's memory."""

    def live_bytes(self) -> int:
        """Bytes of tensors alive now."""
        ...

    def peak_bytes(self) -> int:
        """The most bytes alive at once since the last :meth:`reset_peak`."""
        ...

    def reset_peak(self) -> None:
        """Start a new peak from what is alive now."""
        ...

    def out_of_memory(self) -> str | None:
        """What the first out-of-memory error since the meter started said, or None: the
        script may have caught it and gone on (skipping the batch), but the step did not
        fit."""
        ...


class LiveTensorBytes(TorchDispatchMode):
    """Counts the bytes of live tensor storages on this thread; optionally caps them."""

    def __init__(self, cap: int | None = None) -> None:
        super().__init__()
        self.cap = cap
        self._live = 0
        self._peak = 0
        self._sizes: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._original_resize: Any = None
        self._out_of_memory: str | None = None

    def live_bytes(self) -> int:
        """Bytes of counted storages alive now."""
        return self._live

    def peak_bytes(self) -> int:
        """The most counted bytes alive at once since the last reset."""
        return self._peak

    def reset_peak(self) -> None:
        """Start a new peak from what is alive now."""
        self._peak = self._live

    def out_of_memory(self) -> str | None:
        """The first cap error this count raised, or None."""
        return self._out_of_memory

    def track(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count tensors that were created before the count began (a model's parameters)."""
        for tensor in tensors:
            self._add(tensor)
        self._check(0)

    def _add(self, tensor: torch.Tensor) -> int:
        if tensor.device.type == "meta":
            return 0
        try:
            storage = tensor.untyped_storage()
        except (NotImplementedError, RuntimeError):  # a subclass without storage of its own
            return 0
        if storage in self._sizes:
            return 0
        size = storage.nbytes()
        # The reference (kept alive in the dictionary) subtracts the bytes when torch frees them.
        self._sizes[storage] = [size, weakref.ref(storage, functools.partial(self._freed, size))]
        self._live += size
        return size

    def _freed(self, size: int, _reference: object) -> None:
        self._live -= size

    def _resized(self, storage: torch.UntypedStorage, size: int) -> None:
        self._original_resize(storage, size)
        entry = self._sizes.get(storage)
        if entry is not None:
            old, new = entry[0], storage.nbytes()
            self._live += new - old
            # The finalizer must subtract what is alive at the end, not what was at the start.
            entry[0] = new
            entry[1] = weakref.ref(storage, functools.partial(self._freed, new))
            self._check(max(new - old, 0))

    def _check(self, requested: int) -> None:
        self._peak = max(self._peak, self._live)
        if self.cap is not None and self._live > self.cap:
            message = (
                f"distune device memory cap: {self._live} bytes live after allocating "
                f"{requested} bytes, over the cap of {self.cap} bytes (--autotune_device_memory)"
            )
            self._out_of_memory = self._out_of_memory or message
            raise torch.OutOfMemoryError(message)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        added = sum(self._add(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        if added:
            self._check(added)
        return out

    def __enter__(self) -> LiveTensorBytes:
        self._original_resize = torch.UntypedStorage.resize_
        original = self._original_resize
        mode = self

        @functools.wraps(original)
        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            return mode._resized(storage, size)

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign,assignment]
        del original
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        torch.UntypedStorage.resize_ = self._original_resize  # type: ignore[method-assign]
        super().__exit__(*exc)


class CudaMemory:
    """The CUDA caching allocator's view of one device; ``cap`` shrinks the card."""

    def __init__(self, device: torch.device, cap: int | None = None) -> None:
        self.device = device
        if cap is not None:
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(cap / total, 1.0), device)
        torch.cuda.reset_peak_memory_stats(device)
        self._ooms_before = self._ooms()

    def _ooms(self) -> int:
        return int(torch.cuda.memory_stats(self.device).get("num_ooms", 0))

    def out_of_memory(self) -> str | None:
        """Whether the allocator failed since the meter started (its ``num_ooms``)."""
        failures = self._ooms() - self._ooms_before
        return f"CUDA out of memory ({failures} allocation failure(s))" if failures else None

    def live_bytes(self) -> int:
        """Bytes allocated to tensors now."""
        return int(torch.cuda.memory_allocated(self.device))

    def peak_bytes(self) -> int:
        """The allocator's peak since the last reset."""
        return int(torch.cuda.max_memory_allocated(self.device))

    def reset_peak(self) -> None:
        """Start a new peak."""
        torch.cuda.reset_peak_memory_stats(self.device)


def start_meter(
    device: torch.device, cap: int | None, tensors: Iterable[torch.Tensor]
) -> MemoryMeter:
    """This rank's meter, capped at ``cap`` bytes: the CUDA allocator's on a GPU, else a
    :class:`LiveTensorBytes` entered for the rest of the process (every later step of the job
    is counted and capped), counting ``tensors`` (made before it started) too."""
    if device.type == "cuda":
        return CudaMemory(device, cap)
    mode = LiveTensorBytes(cap)
    mode.__enter__()
    mode.track(tensors)
    return mode
