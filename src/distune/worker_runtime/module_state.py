"""Copying rank 0's parameters and buffers to every rank: at construction, and buffers before
a forward that follows an averaging one (torch DDP's ``forward_sync_buffers=True``, formerly
``broadcast_buffers``).

Tensors are broadcast a few large flat tensors at a time (one per dtype and device, at most
:data:`BROADCAST_CHUNK_BYTES` each) rather than one collective per tensor.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

#: Largest single broadcast.
BROADCAST_CHUNK_BYTES = 64 * 2**20


def _chunks(tensors: Sequence[torch.Tensor], limit: int) -> Iterator[list[torch.Tensor]]:
    chunk: list[torch.Tensor] = []
    size = 0
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if chunk and size + nbytes > limit:
            yield chunk
            chunk, size = [], 0
        chunk.append(tensor)
        size += nbytes
    if chunk:
        yield chunk


@torch.no_grad()
def broadcast_tensors(
    tensors: Sequence[torch.Tensor], process_group: dist.ProcessGroup, src: int
) -> None:
    """Overwrite ``tensors`` with global rank ``src``'s, a few flat broadcasts per dtype."""
    by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for tensor in tensors:
        if tensor.numel() > 0:
            by_kind.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    for same_kind in by_kind.values():
        for chunk in _chunks(same_kind, BROADCAST_CHUNK_BYTES):
            if len(chunk) == 1:
                dist.broadcast(chunk[0], src=src, group=process_group)
                continue
            flat = torch.cat([t.reshape(-1) for t in chunk])
            dist.broadcast(flat, src=src, group=process_group)
            offset = 0
            for tensor in chunk:
                tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
                offset += tensor.numel()


def broadcast_module_state(
    tensors: Sequence[torch.Tensor], process_group: dist.ProcessGroup
) -> None:
    """Copy the group's rank 0's ``tensors`` (the module's parameters, and buffers unless
    torch's rule leaves them out) to every rank (at construction)."""
    if dist.get_world_size(process_group) > 1:
        broadcast_tensors(tensors, process_group, dist.get_global_rank(process_group, 0))


class BufferBroadcast:
    """Broadcasts the module's buffers from one rank before a forward, as torch DDP's
    ``forward_sync_buffers=True`` does: running statistics (batch norm) stay those of rank 0.
    Buffers named in ``ignored`` stay each rank's own."""

    def __init__(
        self, module: nn.Module, process_group: dist.ProcessGroup, ignored: frozenset[str]
    ) -> None:
        self._module = module
        self._ignored = ignored
        self._process_group = process_group
        self._rank0 = dist.get_global_rank(process_group, 0)
        self.needed = dist.get_world_size(process_group) > 1 and any(
            b.numel() > 0 for b in self._buffers()
        )

    def _buffers(self) -> list[torch.Tensor]:
        return [b for n, b in self._module.named_buffers() if n not in self._ignored]

    def __call__(self, src_group_rank: int = 0) -> None:
        """Broadcast from group rank ``src_group_rank`` (rank 0 unless it has joined)."""
        if self.needed:
            src = (
                self._rank0
                if src_group_rank == 0
                else dist.get_global_rank(self._process_group, src_group_rank)
            )
            # Buffers are read each time: a buffer replaced by assignment is still broadcast.
            # Through .data, which autograd does not version, as torch keeps the versions: an
            # earlier forward may have saved a buffer for its backward (batch norm in eval
            # mode), and overwriting it must not fail that backward's check.
            broadcast_tensors([b.data for b in self._buffers()], self._process_group, src)
