"""State dicts of a sharded level-2 run: the whole state, on every rank, and never a hang.

Under ZeRO-2 and ZeRO-3 (torch FSDP) ``run.model.state_dict()`` and ``load_state_dict()`` are
collectives: they gather (or scatter) every rank's shards. So is the whole optimizer state under
ZeRO-1 to 3. A script written for DDP calls them on rank 0 only (``if rank == 0:
torch.save(...)``) while the other ranks go on into training's collectives, which rank 0's then
meet: a wait until the process group's time-out (30 minutes by default), an abort on mismatched
sizes, or a silent pairing. Here each of those calls first meets the other ranks at a monitored
barrier of a gloo group of its own (CPU, whatever the training backend), with a time-out of its
own (``checkpoint_timeout``): where a rank is missing, or is making another of these calls, it
fails within that time, naming the call and the fix. When every rank calls it, the barrier
passes at once and torch's own collective runs.

``run.optimizer.state_dict()`` gives the whole state in torch's own format (parameters numbered
in the optimizer's order), on every rank and under every stage, so a checkpoint resumes under
another stage than the one that wrote it: FSDP's ``optim_state_dict`` (keyed by parameter name)
is renumbered, and ZeRO-1's ``consolidate_state_dict`` runs for the script. How to save and
load: docs/level2.md.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from itertools import chain
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    FullyShardedDataParallel,
    StateDictType,
)
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.utils._pytree import tree_map_only

from distune.errors import DistuneError

#: Seconds the ranks wait for each other at a checkpoint call before failing (distune.prepare's
#: ``checkpoint_timeout``): long enough that a correct script whose rank 0 writes a large file
#: between two calls while the others wait in the second is not failed (a false failure would
#: kill a healthy job); short enough that a rank-0-only call fails in minutes, before the
#: process group's time-out (NCCL's 10 minutes, gloo's 30) ends the job naming nothing.
DEFAULT_CHECKPOINT_TIMEOUT = 300.0

MODEL_STATE = "run.model.state_dict()"
MODEL_LOAD = "run.model.load_state_dict()"
OPTIMIZER_STATE = "run.optimizer.state_dict()"
OPTIMIZER_LOAD = "run.optimizer.load_state_dict()"
_CALLS = (MODEL_STATE, MODEL_LOAD, OPTIMIZER_STATE, OPTIMIZER_LOAD)
_STAGES = {1: "ZeroRedundancyOptimizer", 2: "FSDP", 3: "FSDP"}


class CheckpointCallError(DistuneError, RuntimeError):
    """Not every rank made the same collective state-dict call in time; the message says
    which call, and how to make it on every rank."""


@dataclass(frozen=True)
class RankCheck:
    """Meets every rank before a collective state-dict call, on a gloo group of its own, for at
    most ``timeout``: a missing rank fails the call there, not in torch's collective."""

    group: dist.ProcessGroup
    timeout: timedelta
    stage: int

    @classmethod
    def create(cls, stage: int, timeout_seconds: float) -> RankCheck:
        """A collective of the default group: every rank calls it, in ``distune.prepare``."""
        timeout = timedelta(seconds=timeout_seconds)
        return cls(dist.new_group(backend="gloo", timeout=timeout), timeout, stage)

    def enter(self, call: str) -> None:
        """Return once every rank has entered ``call``; raise if one has not in time, or has
        entered another call."""
        try:
            dist.monitored_barrier(self.group, timeout=self.timeout, wait_all_ranks=True)
        except RuntimeError as error:
            raise CheckpointCallError(self._missing(call, error)) from error
        # Every rank passed the barrier, so this gathers at once.
        calls = torch.empty(self.group.size(), dtype=torch.int64)
        mine = torch.tensor([_CALLS.index(call)], dtype=torch.int64)
        dist.all_gather_into_tensor(calls, mine, group=self.group)
        if len(set(calls.tolist())) > 1:
            made = ", ".join(f"rank {r}: {_CALLS[c]}" for r, c in enumerate(calls.tolist()))
            raise CheckpointCallError(
                f"distune: the ranks made different state-dict calls at once ({made}); under "
                f"ZeRO stage {self.stage} each is a collective that every rank makes in the "
                f"same order: {self._advice(call)}"
            )

    def _missing(self, call: str, error: RuntimeError) -> str:
        seconds = self.timeout.total_seconds()
        torch_says = str(error).strip().splitlines()[0] if str(error).strip() else "no answer"
        return (
            f"distune: {call} under ZeRO stage {self.stage} ({_STAGES[self.stage]}) is a "
            f"collective over every rank's shard, and not every rank made the call (waited up "
            f"to {seconds:g} s; torch: {torch_says}): {self._advice(call)}. (distune.prepare's "
            "checkpoint_timeout sets how long the ranks wait for each other here; after this "
            "error every later state-dict call of this run fails too.)"
        )

    def _advice(self, call: str) -> str:
        stages = "0 or 1" if call in (MODEL_STATE, MODEL_LOAD) else "0"
        if call in (MODEL_LOAD, OPTIMIZER_LOAD):
            how = f"call {call} on every rank, each with the whole state (read the file on each)"
        else:
            how = (
                f"call {call} on every rank (a rank-0-only `if rank == 0: torch.save({call}, "
                "...)` would hang the job) and write the file on rank 0 only"
            )
        return f"{how}, or pin zero_optimization.stage to {stages} in the level-2 config"


def _from_torch_distributed() -> bool:
    """The caller of the patched method (two frames up) is torch.distributed's own code:
    FSDP's ``optim_state_dict`` or torch.distributed.checkpoint, which take the optimizer's
    own (sharded) state and transform it themselves."""
    caller = sys._getframe(2).f_globals.get("__name__", "")
    return caller.startswith("torch.distributed.")


def check_model(model: FullyShardedDataParallel, check: RankCheck) -> None:
    """Make ``model.state_dict()`` and ``load_state_dict()`` meet every rank first."""
    own_state_dict, own_load = model.state_dict, model.load_state_dict

    @functools.wraps(own_state_dict)
    def state_dict(*args: Any, **kwargs: Any) -> Any:
        check.enter(MODEL_STATE)
        return own_state_dict(*args, **kwargs)

    @functools.wraps(own_load)
    def load_state_dict(*args: Any, **kwargs: Any) -> Any:
        check.enter(MODEL_LOAD)
        return own_load(*args, **kwargs)

    # The instance's own methods, as torch.distributed.checkpoint's patch_model_state_dict does.
    model.state_dict = state_dict  # type: ignore[method-assign]
    model.load_state_dict = load_state_dict  # type: ignore[method-assign]


def _patch(
    optimizer: torch.optim.Optimizer,
    save: Callable[[], dict[str, Any]],
    load: Callable[[dict[str, Any]], None],
) -> None:
    """Replace the optimizer's state-dict methods; torch.distributed's own callers get the
    optimizer's own, which they transform themselves."""
    own_state_dict, own_load = optimizer.state_dict, optimizer.load_state_dict

    def patched_state_dict() -> dict[str, Any]:
        return own_state_dict() if _from_torch_distributed() else save()

    def patched_load(state_dict: dict[str, Any]) -> None:
        return own_load(state_dict) if _from_torch_distributed() else load(state_dict)

    optimizer.state_dict = patched_state_dict  # type: ignore[method-assign]
    optimizer.load_state_dict = patched_load  # type: ignore[method-assign]


def _numbered(named: dict[str, Any]) -> dict[str, Any]:
    """FSDP's whole optimizer state (keyed by parameter name) in torch's own format: each
    parameter numbered by its place in the groups, as ``Optimizer.state_dict`` numbers it."""
    names = list(chain.from_iterable(group["params"] for group in named["param_groups"]))
    number = {name: i for i, name in enumerate(names)}
    return {
        "state": {number[name]: value for name, value in named["state"].items()},
        "param_groups": [
            {**group, "params": [number[name] for name in group["params"]]}
            for group in named["param_groups"]
        ],
    }


def _named(numbered: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """Torch's own format back to FSDP's (parameter names for numbers); a state already keyed
    by name (written by FSDP's ``optim_state_dict``) is returned as it is."""
    params = list(chain.from_iterable(group["params"] for group in numbered["param_groups"]))
    if not all(isinstance(p, int) for p in params):
        return numbered
    if len(params) != len(names):
        raise ValueError(
            f"run.optimizer.load_state_dict: the state holds {len(params)} parameters, the "
            f"optimizer {len(names)}"
        )
    name = dict(zip(params, names, strict=True))
    return {
        "state": {name[p]: value for p, value in numbered["state"].items()},
        "param_groups": [
            {**group, "params": [name[p] for p in group["params"]]}
            for group in numbered["param_groups"]
        ],
    }


def whole_fsdp_optimizer(
    model: FullyShardedDataParallel,
    optimizer: torch.optim.Optimizer,
    check: RankCheck,
    names: list[str],
    device: torch.device,
) -> None:
    """Make the optimizer of an FSDP model save and load its whole state, through FSDP's
    ``optim_state_dict`` and ``optim_state_dict_to_load``. ``names`` are its parameters' names
    in its groups' order, as FSDP names them; ``device`` is the model's."""
    own_state_dict, own_load = optimizer.state_dict, optimizer.load_state_dict
    if device.type == "cpu":
        # FSDP's optimizer state dict "offloads to CPU" (its default) with a `.cpu()` that, on
        # CPU, keeps each state a view of the buffer it gathers the next state into: Adam's
        # exp_avg came back as exp_avg_sq (torch 2.13). Not offloading, FSDP clones each one.
        FullyShardedDataParallel.set_state_dict_type(
            model,
            StateDictType.FULL_STATE_DICT,
            FullStateDictConfig(),
            FullOptimStateDictConfig(offload_to_cpu=False),
        )

    def full() -> bool:
        return FullyShardedDataParallel.get_state_dict_type(model).state_dict_type == (
            StateDictType.FULL_STATE_DICT
        )

    def state_dict() -> dict[str, Any]:
        check.enter(OPTIMIZER_STATE)
        named = FullyShardedDataParallel.optim_state_dict(model, optimizer, own_state_dict())
        return _numbered(named) if full() else named

    def load_state_dict(state: dict[str, Any]) -> None:
        check.enter(OPTIMIZER_LOAD)
        named = _named(state, names) if full() else state
        own_load(FullyShardedDataParallel.optim_state_dict_to_load(model, optimizer, named))

    _patch(optimizer, state_dict, load_state_dict)


class ScriptConsolidated:
    """Whether the script consolidated a ZeroRedundancyOptimizer's state itself since its last
    step (a flag the optimizer's step clears)."""

    def __init__(self) -> None:
        self.since_step = False

    def stepped(self, *_: Any) -> None:
        """An optimizer step post-hook: the consolidated state is stale now."""
        self.since_step = False


def whole_zero_optimizer(
    optimizer: ZeroRedundancyOptimizer, check: RankCheck, device: torch.device
) -> None:
    """Make a ZeroRedundancyOptimizer's ``state_dict()`` the whole state on every rank: torch's
    ``consolidate_state_dict(to=0)`` (which the script would have to call on every rank first)
    and rank 0's whole state sent to the others, as DDP's optimizer gives it on every rank.
    A script that follows torch's own protocol (``consolidate_state_dict`` on every rank, then
    ``state_dict()`` on the rank it consolidated to) gets torch's answer, until its next step."""
    own_state_dict, own_load = optimizer.state_dict, optimizer.load_state_dict
    own_consolidate = optimizer.consolidate_state_dict
    consolidated_by_script = ScriptConsolidated()

    def consolidate_state_dict(to: int = 0) -> None:
        own_consolidate(to)
        consolidated_by_script.since_step = True

    def state_dict() -> dict[str, Any]:
        if consolidated_by_script.since_step:
            return own_state_dict()
        check.enter(OPTIMIZER_STATE)
        own_consolidate(to=0)
        first = dist.get_rank(check.group) == 0
        if first:
            whole = own_state_dict()
            # Sent on CPU: a CUDA tensor pickled on rank 0 would land on rank 0's device index.
            sent = [tree_map_only(torch.Tensor, lambda t: t.cpu(), whole)]
            # The check's group holds every rank, so its rank 0 is global rank 0 (torch
            # before 2.6 has no group_src).
            dist.broadcast_object_list(sent, src=0, group=check.group)
            return whole
        received: list[Any] = [None]
        dist.broadcast_object_list(received, src=0, group=check.group)
        return tree_map_only(torch.Tensor, lambda t: t.to(device), received[0])

    def load_state_dict(state: dict[str, Any]) -> None:
        # Local (each rank takes its shard), and never the script's dict: torch's empties the
        # other ranks' entries of the dict it is given.
        own_load({**state, "state": dict(state["state"])})

    optimizer.consolidate_state_dict = consolidate_state_dict  # type: ignore[method-assign]
    optimizer.register_step_post_hook(consolidated_by_script.stepped)
    _patch(optimizer, state_dict, load_state_dict)
