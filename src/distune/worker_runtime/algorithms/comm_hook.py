"""torch DDP's communication hooks (``register_comm_hook``) on distune's engine.

A hook is ``hook(state, bucket) -> torch.futures.Future[torch.Tensor]``: given a bucket of
gradients (the ranks' *sum* is expected, not pre-divided), it returns a future of the averaged
bucket. torch's own (``fp16_compress_hook``, ``bf16_compress_hook``, PowerSGD's
``powerSGD_hook``) run unchanged: the bucket they receive is a :class:`CommHookBucket`, the part
of ``torch.distributed.GradBucket`` they use.

On CPU (gloo) each bucket's hook, including the collectives its future chains (PowerSGD runs two
allreduces per bucket), completes on one worker thread before the next bucket's starts, so every
rank issues the collectives in the same order. On CUDA the hook is called directly, as torch DDP
does.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

from distune.worker_runtime.buckets import Bucket

CommHook = Callable[[Any, Any], "torch.futures.Future[torch.Tensor]"]


class CommHookBucket:
    """What a communication hook sees of one bucket: torch's ``GradBucket`` methods
    ``index``, ``buffer``, ``gradients``, ``parameters``, ``is_last`` and ``set_buffer``."""

    def __init__(self, index: int, is_last: bool, bucket: Bucket) -> None:
        self._index = index
        self._is_last = is_last
        self._bucket = bucket

    def index(self) -> int:
        """The bucket's position in launch order (0 is the first launched)."""
        return self._index

    def is_last(self) -> bool:
        """Whether this is the last bucket of the backward pass."""
        return self._is_last

    def buffer(self) -> torch.Tensor:
        """The flat gradient buffer (1-D), which holds this rank's gradients."""
        return self._bucket.grads

    def gradients(self) -> list[torch.Tensor]:
        """Each parameter's gradient: views of :meth:`buffer`, in bucket order."""
        return list(self._bucket.views)

    def parameters(self) -> list[torch.Tensor]:
        """The bucket's parameters, in the order of :meth:`gradients`."""
        return list(self._bucket.params)

    def set_buffer(self, tensor: torch.Tensor) -> None:
        """Replace the buffer's contents with ``tensor`` (same number of elements)."""
        self._bucket.grads.copy_(tensor.reshape(-1))


class CommHookExchange:
    """Runs a communication hook as the engine's gradient exchange (a ``GradientExchange``)."""

    expects_sum = True

    def __init__(
        self,
        process_group: dist.ProcessGroup,
        state: Any,
        hook: CommHook,
        buckets: Callable[[], Sequence[Bucket]],
    ) -> None:
        if not callable(hook):
            raise TypeError(f"hook must be callable as hook(state, bucket), got {hook!r}")
        self._group = process_group
        self._state = state
        self._hook = hook
        self._buckets = buckets
        self._executor: ThreadPoolExecutor | None = None

    def _call(self, bucket: Bucket) -> torch.Tensor:
        buckets = self._buckets()
        index = next(i for i, b in enumerate(buckets) if b is bucket)
        future = self._hook(self._state, CommHookBucket(index, index == len(buckets) - 1, bucket))
        # torch's hooks return torch._C.Future (what torch.futures.Future wraps): duck-typed.
        if not callable(getattr(future, "wait", None)):
            raise TypeError(
                f"the communication hook must return a torch.futures.Future, got "
                f"{type(future).__name__}"
            )
        return future  # type: ignore[return-value]

    def start(self, bucket: Bucket) -> tuple[Bucket, Any, Any]:
        """Sum the used flags exactly and call the hook on ``bucket``."""
        flags = dist.all_reduce(bucket.flags, group=self._group, async_op=True)
        if bucket.flat.device.type == "cuda":
            return bucket, self._call(bucket), flags
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="distune-comm-hook")
            weakref.finalize(self, self._executor.shutdown, wait=False)
        return bucket, self._executor.submit(_run_to_end, self._call, bucket), flags

    def finish(self, handles: list[tuple[Bucket, Any, Any]]) -> None:
        """Wait for every hook's future and put its value in the bucket."""
        for bucket, pending, flags in handles:
            result = pending.result() if isinstance(pending, Future) else pending.wait()
            if not isinstance(result, torch.Tensor) or result.numel() != bucket.grads.numel():
                raise TypeError(
                    "the communication hook's future must hold a tensor of the bucket's "
                    f"{bucket.grads.numel()} elements, got {result!r:.80}"
                )
            if result.data_ptr() != bucket.grads.data_ptr():
                bucket.grads.copy_(result.reshape(-1))
            flags.wait()


def _run_to_end(call: Callable[[Bucket], Any], bucket: Bucket) -> torch.Tensor:
    return call(bucket).wait()
