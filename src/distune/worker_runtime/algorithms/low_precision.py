"""``LowPrecision``: gradients exchanged in 8 bits (or fp16/bf16), with error feedback.

Each bucket is cut into one chunk per rank. The exchange is a compressed scatter-reduce then
allgather, so every byte on a link is compressed:

1. each rank compresses its whole bucket (8-bit: each block of :data:`BLOCK` values scaled by
   its own min and max to 0..255; fp16/bf16: a cast) and sends chunk ``i`` to rank ``i``
   (``all_to_all``);
2. rank ``i`` decompresses the chunks it received and sums them in full precision: the sum of
   chunk ``i``;
3. rank ``i`` compresses that sum and every rank gathers every chunk (``allgather``).

A rank sends and receives ``(n - 1) / n`` of the bucket in each of the two steps, as a ring
allreduce does, at a quarter (8-bit) or half (16-bit) of the bytes, plus 8 bytes per block for
the 8-bit scales.

Error feedback: what compression dropped, on the way out (each rank) and on the way back (the
rank reducing chunk ``i``), is added to that bucket's next gradient before it is compressed, so
over many steps nothing is lost: the sum of the averaged gradients over ``k`` steps differs from
the exact sum by the last step's rounding only. It is per bucket: a bucket layout change (the
first backward's reordering, a tuned bucket size) starts it afresh.
"""

from __future__ import annotations

import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from distune.worker_runtime.algorithms.base import (
    Algorithm,
    AlgorithmError,
    BucketOrder,
    Buckets,
    GradientExchange,
)
from distune.worker_runtime.buckets import Bucket
from distune.worker_runtime.topology import HierarchicalProcessGroups

_LEVELS = 255  # 8 bits
#: Elements sharing one 8-bit scale (min and step: 8 bytes, 0.4 % of the codes). A chunk of a
#: whole bucket would span parameters of very different magnitudes, and the smallest would round
#: to zero; blocks keep the rounding relative to the values nearby.
BLOCK = 2048
_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class LowPrecision(Algorithm):
    """Gradient averaging with compressed communication (Bagua's ByteGrad).

    Args:
        bits: 8 for min/max-scaled 8-bit integers (a quarter of fp32's bytes), 16 for a
            16-bit float cast (half), given by ``dtype``.
        dtype: with ``bits=16``: ``"fp16"`` (default) or ``"bf16"``.
        error_feedback: carry what compression drops into the next step (recommended).
        hierarchical: on several nodes of several ranks, sum exactly inside each node (to its
            leader), compress only between the node leaders, and broadcast inside the node
            (Bagua's default): the slow links carry the compressed bytes once per node.

    Trades: the link carries a quarter (or half) of the bytes, for quantization noise in each
    step's average (bounded by one quantization step of each chunk's range) and some compute.
    Worth it where the network sets the step time (several nodes on a slow link); on fast links
    the extra compute can make it slower than exact allreduce. The bucket size is tuned;
    hierarchical allreduce is not used.
    """

    bits: int = 8
    dtype: str | None = None
    error_feedback: bool = True
    hierarchical: bool = True
    uses_bucket_size = True
    uses_hierarchical = False
    _cast: torch.dtype | None = field(init=False, repr=False, compare=False, default=None)

    def __post_init__(self) -> None:
        if self.bits not in (8, 16):
            raise AlgorithmError(f"LowPrecision bits must be 8 or 16, got {self.bits!r}")
        if self.bits == 8 and self.dtype is not None:
            raise AlgorithmError("LowPrecision(bits=8) quantizes to integers: give no dtype")
        if self.bits == 16:
            name = "fp16" if self.dtype is None else self.dtype
            if name not in _DTYPES:
                raise AlgorithmError(
                    f"LowPrecision dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}"
                )
            object.__setattr__(self, "_cast", _DTYPES[name])
        for name in ("error_feedback", "hierarchical"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")

    def gradient_exchange(
        self,
        process_group: dist.ProcessGroup,
        buckets: Buckets,
        hierarchy: HierarchicalProcessGroups | None = None,
    ) -> GradientExchange:
        """The compressed scatter-reduce + allgather exchange (between node leaders when
        ``hierarchical`` and there is a hierarchy)."""
        return LowPrecisionExchange(
            process_group,
            buckets,
            self._cast,
            self.error_feedback,
            hierarchy if self.hierarchical else None,
        )


def quantize(
    chunks: torch.Tensor, out: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """8-bit quantization of each row of ``chunks`` (float32 ``[c, m]``) scaled to its own range.

    Returns ``(codes, scales)``: ``codes`` uint8 ``[c, m]`` (written into ``out`` if given);
    ``scales`` float32 ``[c, 2]`` holding each row's minimum and step, so ``dequantize`` maps a
    code ``q`` to ``min + q*step`` and the rounding error of every value is at most half a step.
    """
    low, high = torch.aminmax(chunks, dim=1)
    step = (high - low) / _LEVELS
    # A constant row has step 0: any positive step encodes it exactly (all codes 0).
    step = torch.where(step > 0, step, torch.ones_like(step))
    inverse = step.reciprocal()
    # (x - low) / step in one pass; the clamp guards the top code against the reciprocal's ulp.
    scaled = torch.addcmul((-low * inverse)[:, None], chunks, inverse[:, None])
    scaled.round_().clamp_(0, _LEVELS)
    codes = scaled.to(torch.uint8) if out is None else out.copy_(scaled)
    return codes, torch.stack([low, step], dim=1)


def dequantize(
    codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Inverse of :func:`quantize`, as float32 ``[c, m]`` (into ``out`` if given)."""
    return torch.addcmul(scales[:, 0:1], codes.float(), scales[:, 1:2], out=out)


@dataclass
class _BucketState:
    """What error feedback carries from one step to the next, for one bucket."""

    outgoing: torch.Tensor  # this rank's compression error, the bucket's padded length
    reduced: torch.Tensor  # the error of compressing this rank's reduced chunk


class LowPrecisionExchange:
    """The :class:`GradientExchange` of :class:`LowPrecision`, one per wrapped model.

    On CPU (gloo) each bucket's exchange blocks the host, so exchanges run on one worker thread,
    bucket after bucket in launch order, while backward goes on. On CUDA they are enqueued on a
    side stream that waits for the stream the gradients were made on.
    """

    expects_sum = False

    def __init__(
        self,
        process_group: dist.ProcessGroup,
        buckets: Buckets,
        cast: torch.dtype | None,
        error_feedback: bool,
        hierarchy: HierarchicalProcessGroups | None = None,
    ) -> None:
        self._order = BucketOrder(buckets)
        self._hierarchy = hierarchy
        # Compressed among the node leaders under a hierarchy, else among all ranks.
        self._group = process_group if hierarchy is None else hierarchy.leaders
        self._world = 0 if self._group is None else dist.get_world_size(self._group)
        self._cast = cast
        self._error_feedback = error_feedback
        self._states: weakref.WeakKeyDictionary[Bucket, _BucketState] = weakref.WeakKeyDictionary()
        self._executor: ThreadPoolExecutor | None = None
        self._stream: Any = None

    def start(self, flat: torch.Tensor) -> Future[None] | None:
        """Compress and exchange the next bucket, in ``flat`` (already divided by the world
        size)."""
        _, _, bucket = self._order.next()
        device = flat.device
        if device.type == "cuda":
            if self._stream is None:
                self._stream = torch.cuda.Stream(device)
            self._stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(self._stream):
                self.exchange(flat, bucket)
            return None
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="distune-low-precision")
            weakref.finalize(self, self._executor.shutdown, wait=False)
        return self._executor.submit(self.exchange, flat, bucket)

    def finish(self, handles: list[Any]) -> None:
        """Wait for every bucket's exchange."""
        self._order.reset()
        if self._stream is not None:
            torch.cuda.current_stream(self._stream.device).wait_stream(self._stream)
        for handle in handles:
            if handle is not None:
                handle.result()

    def close(self) -> None:
        """Stop the worker thread (pending exchanges are abandoned)."""
        if self._executor is not None:
            self._executor.shutdown(wait=False)

    def exchange(self, flat: torch.Tensor, bucket: Bucket) -> None:
        """The whole exchange of one bucket (``flat`` laid out as ``bucket``), blocking until
        its average is in ``flat``. Error feedback is kept per ``bucket``."""
        hierarchy = self._hierarchy
        if hierarchy is None:
            self._compressed(flat, bucket)
            return
        # Exact sum inside the node; compressed between leaders; the result back to the node.
        dist.reduce(flat, dst=hierarchy.leader, group=hierarchy.intra)
        if hierarchy.is_leader:
            self._compressed(flat, bucket)
        dist.broadcast(flat, src=hierarchy.leader, group=hierarchy.intra)

    def _compressed(self, flat: torch.Tensor, bucket: Bucket) -> None:
        length = bucket.grads.numel()
        grads = flat[:length]
        flags = dist.all_reduce(
            flat[length : length + len(bucket.flags)], group=self._group, async_op=True
        )
        n = self._world
        # Each rank's chunk is a whole number of blocks (one block if the bucket is small).
        block = min(BLOCK, -(-length // n))
        per_rank = -(-length // (n * block)) * block
        padded = n * per_rank
        state = self._states.get(bucket)
        if self._error_feedback and state is None:
            state = _BucketState(
                torch.zeros(padded, dtype=torch.float32, device=grads.device),
                torch.zeros(padded // n, dtype=torch.float32, device=grads.device),
            )
            self._states[bucket] = state
        if state is not None:
            # What was dropped last time, plus this step's gradients: compressed in place.
            values = state.outgoing
            values[:length] += grads
        elif padded == length and grads.dtype == torch.float32:
            values = grads  # read only until the result is written back
        else:
            values = torch.zeros(padded, dtype=torch.float32, device=grads.device)
            values[:length] = grads
        chunks = values.view(n, padded // n)
        # Scatter-reduce: chunk i of every rank to rank i, summed there in full precision.
        sent = self._compress(chunks, block, keep_error=state is not None)
        received = torch.empty_like(sent)
        dist.all_to_all_single(received, sent, group=self._group)
        reduced = self._decompress(received, block).sum(dim=0, keepdim=True)
        if state is not None:
            reduced += state.reduced
        # Allgather: every rank's reduced chunk to every rank.
        mine = self._compress(reduced, block, keep_error=state is not None)
        if state is not None:
            state.reduced.copy_(reduced[0])
        gathered = torch.empty((n, *mine.shape[1:]), dtype=mine.dtype, device=mine.device)
        _all_gather_single(gathered, mine, self._group)
        if padded == length and grads.dtype == torch.float32:
            self._decompress(gathered, block, out=grads.view(n, -1))
        else:
            grads.copy_(self._decompress(gathered, block).view(-1)[:length])
        flags.wait()

    def _compress(self, chunks: torch.Tensor, block: int, keep_error: bool) -> torch.Tensor:
        """Rows of ``chunks`` as one wire row each; with ``keep_error``, ``chunks`` is left
        holding what compression dropped (the value minus what the receiver will decode)."""
        if self._cast is not None:
            wire = chunks.to(self._cast)
            if keep_error:
                chunks.sub_(wire.float())
            return wire
        rows, width = chunks.shape
        blocks = chunks.view(-1, block)
        codes, scales = quantize(blocks)
        # Each row's scales travel in front of its codes: 8 bytes per block.
        head = 8 * (width // block)
        wire = torch.empty((rows, head + width), dtype=torch.uint8, device=chunks.device)
        wire[:, :head] = scales.view(rows, -1).view(torch.uint8)
        wire[:, head:] = codes.view(rows, width)
        if keep_error:
            blocks.sub_(dequantize(codes, scales))
        return wire

    def _decompress(
        self, wire: torch.Tensor, block: int, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        if self._cast is not None:
            return wire.float() if out is None else out.copy_(wire)
        rows = wire.shape[0]
        width = (wire.shape[1] * block) // (block + 8)
        head = wire.shape[1] - width
        # A fresh copy: its row stride is the head's, as viewing bytes as floats needs.
        scales = wire[:, :head].clone(memory_format=torch.contiguous_format)
        scales = scales.view(torch.float32).view(-1, 2)
        codes = wire[:, head:].reshape(-1, block)
        values = dequantize(codes, scales, out=None if out is None else out.view(-1, block))
        return values.view(rows, width)


def _all_gather_single(output: torch.Tensor, tensor: torch.Tensor, group: Any) -> None:
    # torch 2.13 renamed all_gather_into_tensor; older releases have only the old name.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, tensor, group=group)
