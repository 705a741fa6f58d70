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
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

from distune.worker_runtime.algorithms.base import BucketOrder, Buckets
from distune.worker_runtime.buckets import Bucket

CommHook = Callable[[Any, Any], "torch.futures.Future[torch.Tensor]"]


class CommHookBucket:
    """What a communication hook sees of one bucket: torch's ``GradBucket`` methods
    ``index``, ``buffer``, ``gradients``, ``parameters``, ``is_last`` and ``set_buffer``."""

    def __init__(self, index: int, is_last: bool, flat: torch.Tensor, bucket: Bucket) -> None:
        self._index = index
        self._is_last = is_last
        self._bucket = bucket
        self._grads = flat[: bucket.grads.numel()]

    def index(self) -> int:
        """The bucket's position in launch order (0 is the first launched)."""
        return self._index

    def is_last(self) -> bool:
        """Whether this is the last bucket of the backward pass."""
        return self._is_last

    def buffer(self) -> torch.Tensor:
        """The flat gradient buffer (1-D), which holds this rank's gradients."""
        return self._grads

    def gradients(self) -> list[torch.Tensor]:
        """Each parameter's gradient: views of :meth:`buffer`, in bucket order."""
        return [
            self._grads[start:end].view_as(view)
            for (start, end), view in zip(self._bucket.spans, self._bucket.views, strict=True)
        ]

    def parameters(self) -> list[torch.Tensor]:
        """The bucket's parameters, in the order of :meth:`gradients`."""
        return list(self._bucket.params)

    def set_buffer(self, tensor: torch.Tensor) -> None:
        """Make ``tensor`` the buffer, as torch's ``GradBucket.set_buffer`` does: later
        :meth:`buffer` and :meth:`gradients` calls see it, in its own dtype. torch's
        ``fp16_compress_wrapper`` and ``bf16_compress_wrapper`` send the cast copy they set;
        copied back into the bucket, it was sent in the bucket's dtype, uncompressed, and
        summed at another precision than torch's."""
        self._grads = tensor


class CommHookExchange:
    """Runs a communication hook as the engine's gradient exchange (a ``GradientExchange``)."""

    expects_sum = True

    def __init__(
        self,
        process_group: dist.ProcessGroup,
        state: Any,
        hook: CommHook,
        buckets: Buckets,
    ) -> None:
        if not callable(hook):
            raise TypeError(f"hook must be callable as hook(state, bucket), got {hook!r}")
        self._group = process_group
        self._state = state
        self._hook = hook
        self._order = BucketOrder(buckets)
        self._executor: ThreadPoolExecutor | None = None

    def _call(self, index: int, count: int, flat: torch.Tensor, bucket: Bucket) -> Any:
        future = self._hook(self._state, CommHookBucket(index, index == count - 1, flat, bucket))
        # torch's hooks return torch._C.Future (what torch.futures.Future wraps): duck-typed.
        if not callable(getattr(future, "wait", None)):
            raise TypeError(
                f"the communication hook must return a torch.futures.Future, got "
                f"{type(future).__name__}"
            )
        return future

    def start(self, flat: torch.Tensor) -> tuple[torch.Tensor, int, Any, Any]:
        """Sum the used flags exactly and call the hook on the next bucket, in ``flat``."""
        index, count, bucket = self._order.next()
        length = bucket.grads.numel()
        flags = dist.all_reduce(
            flat[length : length + len(bucket.flags)], group=self._group, async_op=True
        )
        if flat.device.type == "cuda":
            return flat, length, self._call(index, count, flat, bucket), flags
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="distune-comm-hook")
            weakref.finalize(self, self._executor.shutdown, wait=False)
        pending = self._executor.submit(_run_to_end, self._call, index, count, flat, bucket)
        return flat, length, pending, flags

    def finish(self, handles: list[tuple[torch.Tensor, int, Any, Any]]) -> None:
        """Wait for every hook's future and put its value in the bucket."""
        self._order.reset()
        for flat, length, pending, flags in handles:
            result = pending.result() if isinstance(pending, Future) else pending.wait()
            if not isinstance(result, torch.Tensor) or result.numel() != length:
                raise TypeError(
                    "the communication hook's future must hold a tensor of the bucket's "
                    f"{length} elements, got {result!r:.80}"
                )
            if result.data_ptr() != flat.data_ptr():
                flat[:length].copy_(result.reshape(-1))
            flags.wait()


def _run_to_end(call: Callable[..., Any], *args: Any) -> torch.Tensor:
    return call(*args).wait()
