"""Uneven inputs: ``with model.join(): ...`` as with torch DDP, on torch's Join library.

A rank that runs out of batches leaves the loop and waits in the ``Join`` context manager
(``torch.distributed.algorithms.join``). The ranks still training notify the context at each
forward (one allreduce, torch's). For every such iteration the joined rank runs
:meth:`DistributedDataParallelJoinHook.main_hook`, which joins the same collectives with zeros:
one small allreduce saying whether the iteration averages and which rank broadcasts buffers
(both decided at the forward, on the ranks still training: see :func:`forward_agreement`),
the buffer broadcast, then every bucket's allreduce, the one-time order broadcast and the
sync point, exactly as a synchronised backward runs them. Gradients are divided by the initial
world size (torch's default, ``divide_by_initial_world_size=True``): the joined ranks add zeros.

When every rank has joined, the post hook copies the parameters and buffers of the last rank
to join to all ranks (torch DDP does the same), so every rank ends with the same model.

A model-averaging algorithm (``Decentralized``, ``AsyncModelAverage``) runs collectives of its
own before forwards that a joined rank could not shadow: ``join()`` refuses it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import JoinHook

from distune.worker_runtime.module_state import broadcast_tensors

if TYPE_CHECKING:
    from distune.worker_runtime.distributed import DistributedDataParallel


def forward_agreement(
    process_group: dist.ProcessGroup, device: torch.device, averages: bool | None
) -> tuple[bool, int]:
    """Whether any rank still training averages this iteration, and the highest group rank
    among them (the source of the buffer broadcast: rank 0 may have joined).

    ``averages`` is ``None`` on a joined rank. A collective, once per iteration under join.
    """
    rank = dist.get_rank(process_group)
    mine = [-1.0, -1.0] if averages is None else [float(averages), float(rank)]
    tensor = torch.tensor(mine, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=process_group)
    averaged, source = tensor.tolist()
    return averaged > 0, int(source)


class DistributedDataParallelJoinHook(JoinHook):
    """Shadows one iteration of the ranks still training on a rank that has joined."""

    def __init__(self, model: DistributedDataParallel) -> None:
        self._model = model

    def main_hook(self) -> None:
        """Join one iteration's collectives, in the order the training ranks run them."""
        model = self._model
        process_group = model.join_process_group
        averages, source = forward_agreement(process_group, model.join_device, None)
        if not averages:
            return  # a forward under no_sync: nothing else is collective
        if model.forward_sync_buffers and model._buffer_broadcast is not None:
            model._buffer_broadcast(source)
        model._runtime().shadow_backward()

    def post_hook(self, is_last_joiner: bool) -> None:
        """Copy the last joiner's parameters (and buffers, where forwards broadcast them) to
        every rank, ignored ones left out: torch's rule."""
        model = self._model
        process_group = model.join_process_group
        _, source = forward_agreement(
            process_group, model.join_device, True if is_last_joiner else None
        )
        tensors = model._state_tensors(model.forward_sync_buffers)
        src = dist.get_global_rank(process_group, source)
        broadcast_tensors(tensors, process_group, src)
