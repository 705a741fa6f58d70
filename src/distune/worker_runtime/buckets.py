"""Assignment of parameters to flat gradient buckets, whose slices are the parameters' ``.grad``.

A bucket is one contiguous tensor per (dtype, device) holding the gradients of several
parameters back to back, followed by one *used flag* per parameter. Each parameter's ``.grad``
is a view into the bucket (as torch DDP's ``gradient_as_bucket_view``), so autograd accumulates
straight into the buffer that is allreduced and launching a bucket copies nothing. The flags
travel in the same allreduce and count the ranks on which each parameter received a gradient;
they are read only when a parameter was unused on this rank (see :mod:`.reducer`).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch


def assign_buckets(
    sizes: Sequence[int], keys: Sequence[Hashable], order: Sequence[int], bucket_size: int
) -> tuple[tuple[int, ...], ...]:
    """Group parameter indices into buckets of at most ``bucket_size`` bytes.

    ``sizes[i]`` is parameter ``i``'s gradient bytes and ``keys[i]`` its (dtype, device): a
    bucket holds one key only. Parameters are taken in ``order`` (the order their gradients are
    expected to be ready: reverse registration order at first); each key fills its own open
    bucket, which is closed when the next parameter would overflow it, so a parameter larger than
    a bucket gets a bucket of its own. Buckets are returned in the order they become complete
    (the position in ``order`` of their last parameter): the order they are launched in.
    """
    if bucket_size <= 0:
        raise ValueError(f"bucket_size must be a positive number of bytes, got {bucket_size}")
    if sorted(order) != list(range(len(sizes))) or len(keys) != len(sizes):
        raise ValueError("order must be a permutation of the parameter indices")
    position = {index: pos for pos, index in enumerate(order)}
    open_buckets: dict[Hashable, tuple[list[int], int]] = {}
    closed: list[list[int]] = []
    for index in order:
        if sizes[index] > bucket_size:
            closed.append([index])
            continue
        key = keys[index]
        members, used = open_buckets.get(key, ([], 0))
        if members and used + sizes[index] > bucket_size:
            closed.append(members)
            members, used = [], 0
        members.append(index)
        open_buckets[key] = (members, used + sizes[index])
    closed.extend(members for members, _ in open_buckets.values())
    closed.sort(key=lambda members: position[members[-1]])
    return tuple(tuple(members) for members in closed)


@dataclass(frozen=True)
class Slot:
    """Where one parameter's gradient lives: its bucket and its position in that bucket."""

    bucket: int
    index: int


class Bucket:
    """One flat buffer holding the gradients of ``params`` and their used flags.

    ``grads`` is the gradient part (what is averaged), ``flags`` the tail of one element per
    parameter, and ``views[k]`` the slice shaped like ``params[k]`` that becomes its ``.grad``.
    """

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        first = params[0]
        #: The parameters whose gradients the bucket holds, in bucket order.
        self.params = tuple(params)
        numels = [p.numel() for p in params]
        total = sum(numels)
        # The flags' tail is padded to a multiple of 16 elements, so the allreduced length keeps
        # the alignment gloo and NCCL reduce fastest. Zeros: a view handed out before any
        # backward holds a valid (empty) gradient.
        padded = -(-(total + len(params)) // 16) * 16
        self.flat = torch.zeros(padded, dtype=first.dtype, device=first.device)
        self.grads = self.flat[:total]
        self.flags = self.flat[total : total + len(params)]
        self.views: list[torch.Tensor] = []
        self.spans: list[tuple[int, int]] = []
        offset = 0
        for param, numel in zip(params, numels, strict=True):
            self.views.append(self.flat[offset : offset + numel].view(param.shape))
            self.spans.append((offset, offset + numel))
            offset += numel

    @property
    def nbytes(self) -> int:
        """Bytes of gradient the bucket carries (flags excluded)."""
        return self.grads.numel() * self.grads.element_size()
