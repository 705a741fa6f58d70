"""Every rank wraps the same model and starts on the same buckets, checked at construction.

torch DDP verifies that every rank built the same parameters (``verify_params_across_processes``)
before anything is averaged; a mismatch would otherwise train silently on swapped shapes or
abort at the first backward with a size mismatch inside gloo or NCCL. Here the ranks gather each
other's parameter list (name, shape, dtype) and starting group in one ``all_gather_object``;
every rank reaches the same verdict from the same data, so all raise together or none does.

The starting group can differ between ranks only through their environment (a
``DISTUNE_BUCKET_SIZE`` set on one rank): rank 0's wins, with a warning on the ranks it
overrides, since differing buckets would pair collectives of different sizes.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from distune.errors import DistuneError
from distune.space import Hyperparameters

logger = logging.getLogger(__name__)


class ModelMismatchError(DistuneError, ValueError):
    """The ranks wrapped different models; the message names the first difference."""


@dataclass(frozen=True)
class ParameterSignature:
    """What must agree across ranks about one parameter."""

    name: str
    shape: tuple[int, ...]
    dtype: str


def signatures(named: Sequence[tuple[str, torch.Tensor]]) -> list[ParameterSignature]:
    """The signatures of ``named`` parameters, in order."""
    return [ParameterSignature(n, tuple(p.shape), str(p.dtype)) for n, p in named]


def first_difference(
    mine: Sequence[ParameterSignature], reference: Sequence[ParameterSignature]
) -> str | None:
    """How ``mine`` differs from ``reference`` (rank 0's), or ``None`` if it does not."""
    if len(mine) != len(reference):
        return f"{len(mine)} trainable parameters where rank 0 has {len(reference)}"
    for a, b in zip(mine, reference, strict=True):
        if (a.shape, a.dtype) != (b.shape, b.dtype):
            return (
                f"parameter {a.name!r} is {list(a.shape)} {a.dtype} where rank 0's "
                f"{b.name!r} is {list(b.shape)} {b.dtype}"
            )
    return None


def agree_on_model(
    process_group: dist.ProcessGroup,
    named: Sequence[tuple[str, torch.Tensor]],
    start: Hyperparameters,
) -> Hyperparameters:
    """Check that every rank of ``process_group`` wraps parameters like this rank's; return
    rank 0's starting group. A collective: every rank calls it, at construction."""
    mine = (signatures(named), start.to_dict())
    gathered: list[tuple[list[ParameterSignature], dict] | None] = [None] * dist.get_world_size(
        process_group
    )
    dist.all_gather_object(gathered, mine, group=process_group)
    reference, reference_start = gathered[0]  # type: ignore[misc]
    problems = []
    for rank, entry in enumerate(gathered[1:], start=1):
        difference = first_difference(entry[0], reference)  # type: ignore[index]
        if difference is not None:
            problems.append(f"rank {rank}: {difference}")
    if problems:
        raise ModelMismatchError(
            "the ranks wrapped different models (every rank must build the same parameters, "
            "in the same order, before wrapping): " + "; ".join(problems[:4])
        )
    agreed = Hyperparameters.from_dict(reference_start)
    if agreed != start:
        logger.warning(
            "this rank would start on %s but rank 0 starts on %s (different DISTUNE_* "
            "settings?): following rank 0, as every rank must",
            start.describe(),
            agreed.describe(),
        )
    return agreed
