"""Every rank wraps the same model and starts on the same buckets, checked at construction.

torch DDP verifies that every rank built the same parameters (``verify_params_across_processes``)
before anything is averaged; a mismatch would otherwise train silently on swapped shapes or
abort at the first backward with a size mismatch inside gloo or NCCL. Here the ranks gather each
other's parameter list (name, shape, dtype) and starting group in one ``all_gather_object``;
every rank reaches the same verdict from the same data, so all raise together or none does.

The starting group, and whether the model tunes, can differ between ranks only through their
environment (a ``DISTUNE_BUCKET_SIZE`` set on one rank, a node launched with other autotune
flags): rank 0's wins, with a warning on the ranks it overrides, since differing buckets
would pair collectives of different sizes, and a rank that skips the sync points' collective
would pair another with it.

Later, ``set_hyperparameters`` must be called by every rank with the same value, or the ranks'
buckets differ: gloo then aborts the process at the next backward on a size mismatch that
names no cause, and NCCL pairs buckets of different sizes. Each call is checked through the
job's store rather than a collective of the group, so a rank that never calls cannot pair the
check with a gradient allreduce: the callers wait for the others' entries as long as any
collective of the job would (``init_process_group``'s ``timeout``), then raise naming the call.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from distune.errors import DistuneError
from distune.space import Hyperparameters

logger = logging.getLogger(__name__)


class ModelMismatchError(DistuneError, ValueError):
    """The ranks wrapped different models; the message names the first difference."""


#: Seconds at most before a rank waiting for the others' ``set_hyperparameters`` says so.
SWITCH_NOTICE = timedelta(seconds=30)


class CollectiveCallError(DistuneError, RuntimeError):
    """A call every rank must make together was not: some ranks did not make it (within the
    job's collective time-out), or made it with other values; the message names the call."""


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


@dataclass(frozen=True)
class ModelAgreement:
    """What every rank takes from rank 0 at construction."""

    #: The starting group.
    hyperparameters: Hyperparameters
    #: Whether the model tunes itself (joins the sync points).
    tuning: bool


def agree_on_model(
    process_group: dist.ProcessGroup,
    named: Sequence[tuple[str, torch.Tensor]],
    start: Hyperparameters,
    tuning: bool,
) -> ModelAgreement:
    """Check that every rank of ``process_group`` wraps parameters like this rank's; return
    rank 0's starting group and whether it tunes. A collective: every rank calls it, at
    construction."""
    mine = (signatures(named), start.to_dict(), tuning)
    gathered: list[tuple[list[ParameterSignature], dict, bool] | None] = [
        None
    ] * dist.get_world_size(process_group)
    dist.all_gather_object(gathered, mine, group=process_group)
    reference, reference_start, reference_tuning = gathered[0]  # type: ignore[misc]
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
    if tuning != reference_tuning:
        logger.warning(
            "this rank would %s but rank 0 %s (its node launched with other flags, such as "
            "--autotune_level or --nproc_per_node, or other DISTUNE_* settings?): following "
            "rank 0, as every rank must",
            "tune the model" if tuning else "not tune the model",
            "tunes it" if reference_tuning else "does not",
        )
    return ModelAgreement(agreed, reference_tuning)


def agree_on_switch(
    process_group: dist.ProcessGroup, name: str, call: int, hyperparameters: Hyperparameters
) -> None:
    """Check that every rank of ``process_group`` makes call number ``call`` of model
    ``name``'s ``set_hyperparameters``, with the same value; :class:`CollectiveCallError`
    otherwise, on each rank that made it. Through the job's store, not a collective."""
    store = dist.distributed_c10d._get_default_store()
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    prefix = f"distune/set_hyperparameters/{attempt}/{name}/{call}/"
    ranks = dist.get_process_group_ranks(process_group)
    store.set(f"{prefix}{dist.get_rank()}", json.dumps(hyperparameters.to_dict()))
    what = f"set_hyperparameters call {call + 1} of model {name!r}"
    timeout: timedelta = store.timeout  # type: ignore[attr-defined]  # bound, not in torch's stubs
    keys = [f"{prefix}{rank}" for rank in ranks]
    # Within half the time-out (30 s at most) the wait is said, so it is never silent.
    notice = min(SWITCH_NOTICE, timeout / 2)
    try:
        store.wait(keys, notice)
    except RuntimeError:  # torch's DistStoreError: the wait's time-out passed
        logger.warning(
            "%s: waiting for rank(s) %s, %g s more at most: every rank must call it at the same "
            "iteration",
            what,
            ", ".join(map(str, _missing(store, keys, ranks))),
            (timeout - notice).total_seconds(),
        )
        try:
            store.wait(keys, timeout - notice)
        except RuntimeError:
            missing = _missing(store, keys, ranks)
            raise CollectiveCallError(
                f"{what}: rank(s) {', '.join(map(str, missing))} did not make it within "
                f"{timeout.total_seconds():g} s (the process group's timeout). It is a "
                "collective: every rank calls it at the same iteration with the same value; a "
                "rank that does not would average gradients in buckets of other sizes"
            ) from None
    values = {rank: store.get(f"{prefix}{rank}").decode() for rank in ranks}
    if len(set(values.values())) > 1:
        given = "; ".join(
            f"rank {rank}: {Hyperparameters.from_dict(json.loads(v)).describe()}"
            for rank, v in values.items()
        )
        raise CollectiveCallError(
            f"{what}: the ranks gave different values ({given}); every rank must give the same"
        )


def _missing(store: dist.Store, keys: list[str], ranks: list[int]) -> list[int]:
    """The ranks whose key is not in ``store`` yet."""
    return [rank for rank, key in zip(ranks, keys, strict=True) if not store.check([key])]
