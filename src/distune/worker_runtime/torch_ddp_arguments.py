"""torch DDP's constructor arguments, as distune's wrapper takes them.

The arguments are bound against the signature of the installed torch's
``torch.nn.parallel.DistributedDataParallel.__init__`` (``inspect``), so a call torch would
refuse (an unknown keyword, too many positional arguments) raises the ``TypeError`` torch's
would, and an argument a newer torch adds is refused by name unless left at its default: no
argument that could change the training math is ever ignored. Each known one either does what
it does in torch's DDP or needs no work here, for the reason beside it:

* ``device_ids``, ``output_device``: the module sits on one device; outputs stay there, which is
  what torch does for a single-device module. Given, they must name that device.
* ``dim``: where torch's single-process multi-device mode splits inputs; it has no effect on a
  single-device module, in torch as here.
* ``forward_sync_buffers`` (torch 2.13) and the older ``broadcast_buffers``: buffers are
  broadcast from rank 0 before a forward that follows an averaging one; torch's rule decides
  which one wins and whether construction broadcasts buffers (``broadcast_buffers=False``
  does not).
* ``init_sync``: whether construction broadcasts rank 0's parameters (and buffers).
* ``process_group``, ``device_mesh`` (a 1-D mesh: its group): the ranks gradients are averaged
  over.
* ``bucket_cap_mb``: pins the bucket size (MiB, rounded to a power of two of bytes); not tuned.
  0 is torch's one bucket per parameter (1-byte buckets here).
* ``find_unused_parameters``, ``skip_all_reduce_unused_params``: unused parameters are always
  handled, at no cost when all are used; the averages are torch's either way.
* ``gradient_as_bucket_view``, ``batched_grad_copy``: gradients are always views of the buckets,
  and small ones are divided a bucket at a time.
* ``static_graph``: the bucket order is learned from the first backward, which is what a static
  graph allows torch to do; reentrant checkpointing is handled without it.
* ``delay_all_reduce_named_params`` with ``param_to_hook_all_reduce``: torch averages those
  parameters later in the backward; here they are averaged with the others, to the same values.
* ``check_reduction``: deprecated in torch and ignored there too.

Refused, by name: ``mixed_precision`` (casts parameters to a lower precision for the forward:
use ``torch.autocast``) and ``bucket_cap_mb_list`` (one size per bucket: distune's buckets have
one size, ``bucket_cap_mb``).
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from distune.errors import DistuneError
from distune.space import BUCKET_SIZE_2P_LIMITS

#: Bytes in one of ``bucket_cap_mb``'s megabytes (torch counts MiB).
MIB = 2**20

#: Boolean arguments that need no work here (the module docstring says why for each).
_NO_WORK_FLAGS = (
    "find_unused_parameters",
    "check_reduction",
    "gradient_as_bucket_view",
    "static_graph",
    "skip_all_reduce_unused_params",
    "batched_grad_copy",
)

#: Arguments handled by name below; any other argument of torch's must keep its default.
_HANDLED = frozenset(
    {
        "module",
        "device_ids",
        "output_device",
        "dim",
        "broadcast_buffers",
        "forward_sync_buffers",
        "init_sync",
        "process_group",
        "device_mesh",
        "bucket_cap_mb",
        "delay_all_reduce_named_params",
        "param_to_hook_all_reduce",
        *_NO_WORK_FLAGS,
    }
)

#: Arguments that would change what is computed and that distune does not do, with the way to
#: get the same effect.
_REFUSED = {
    "mixed_precision": (
        "distune averages gradients in the parameters' own dtype; for a bf16/fp16 forward "
        "use torch.autocast (or cast the module), for low-precision communication "
        "algorithm=distune.algorithms.LowPrecision(...) or register_comm_hook"
    ),
    "bucket_cap_mb_list": (
        "distune's buckets have one size: use bucket_cap_mb (MiB) or bucket_size (bytes), or "
        "leave it to the tuner"
    ),
}


class UnsupportedArgumentError(DistuneError, ValueError):
    """A torch DDP constructor argument distune does not implement was given a value other
    than torch's default; the message names it and what to use instead."""


@dataclass(frozen=True)
class TorchDDPArguments:
    """What distune takes from torch DDP's arguments.

    ``values`` holds every argument of the installed torch's signature but ``module``, bound
    and defaulted as torch binds them. ``device`` is where gradients live; ``process_group``
    the group they are averaged over; ``forward_sync_buffers`` whether buffers are broadcast
    before forwards that average; ``init_sync`` and ``init_sync_buffers`` whether construction
    broadcasts parameters, and buffers; ``bucket_size`` a pinned bucket size in bytes
    (``None``: not pinned); ``device_ids`` and ``output_device`` torch's attributes (device
    indices of a CUDA module, else ``None``).
    """

    values: Mapping[str, Any]
    device: torch.device
    process_group: dist.ProcessGroup
    forward_sync_buffers: bool
    init_sync: bool
    init_sync_buffers: bool
    bucket_size: int | None
    device_ids: list[int] | None
    output_device: int | None

    @classmethod
    def bind(
        cls,
        module: nn.Module,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        params: Sequence[torch.Tensor],
        bucket_size: int | None,
    ) -> TorchDDPArguments:
        """Bind ``module, *args, **kwargs`` as torch's constructor would and validate them for
        a module whose averaged parameters are ``params``; ``bucket_size`` is distune's own."""
        signature = inspect.signature(torch.nn.parallel.DistributedDataParallel.__init__)
        bound = signature.bind(None, module, *args, **kwargs)  # TypeError as torch's
        bound.apply_defaults()
        values = dict(bound.arguments)
        del values["self"], values["module"]
        _refuse_unsupported(values, signature)
        for name in ("init_sync", *_NO_WORK_FLAGS):
            if name in values:
                _check_bool(name, values[name])
        dim = values.get("dim", 0)
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise TypeError(f"dim must be an int, got {dim!r}")
        _check_delayed(values, params)
        device = _single_device(params, values.get("device_ids"))
        device_ids, output_device = _device_attributes(
            device, values.get("device_ids"), values.get("output_device")
        )
        forward_sync, init_sync_buffers = _buffer_sync(
            values.get("broadcast_buffers"), values.get("forward_sync_buffers")
        )
        return cls(
            values,
            device,
            _process_group(values.get("process_group"), values.get("device_mesh")),
            forward_sync,
            values.get("init_sync", True),
            init_sync_buffers,
            _pinned_bytes(values.get("bucket_cap_mb"), bucket_size),
            device_ids,
            output_device,
        )


def _refuse_unsupported(values: Mapping[str, Any], signature: inspect.Signature) -> None:
    for name, value in values.items():
        default = signature.parameters[name].default
        if name in _HANDLED or value is default or _is_default(value, default):
            continue
        reason = _REFUSED.get(
            name,
            "this torch's DistributedDataParallel has an argument distune does not know, so it "
            "cannot promise torch's behaviour: leave it at its default",
        )
        raise UnsupportedArgumentError(
            f"{name}={value!r} is not supported by distune.DistributedDataParallel: {reason}"
        )


def _is_default(value: Any, default: Any) -> bool:
    if default is None:
        # torch reads an empty list (bucket_cap_mb_list=[]) as None: uniform buckets.
        return value is None or (isinstance(value, list | tuple) and not value)
    try:
        return bool(value == default)
    except (RuntimeError, TypeError, ValueError):  # e.g. a tensor compared with a default
        return False


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")


def _check_delayed(values: Mapping[str, Any], params: Sequence[torch.Tensor]) -> None:
    """torch's rule for the delayed allreduce: both arguments or neither, and (distune's
    check) parameters of this module, so that averaging them with the others is torch's
    average."""
    delayed = values.get("delay_all_reduce_named_params")
    hook = values.get("param_to_hook_all_reduce")
    if (delayed is None) != (hook is None):
        raise ValueError(
            "delay_all_reduce_named_params and param_to_hook_all_reduce need to be set at the "
            "same time."
        )
    if delayed is None:
        return
    known = {id(p) for p in params}
    foreign = [n for n, p in delayed if id(p) not in known]
    if foreign or id(hook) not in known:
        raise ValueError(
            "delay_all_reduce_named_params and param_to_hook_all_reduce must be trainable "
            f"parameters of the module (not: {foreign or ['param_to_hook_all_reduce']})"
        )


def _buffer_sync(
    broadcast_buffers: bool | None, forward_sync_buffers: bool | None
) -> tuple[bool, bool]:
    """torch's rule: (broadcast before forwards, broadcast at construction).

    ``forward_sync_buffers`` wins when given and never stops the construction broadcast;
    the older ``broadcast_buffers`` (default ``True``) decides both.
    """
    for name, value in (
        ("broadcast_buffers", broadcast_buffers),
        ("forward_sync_buffers", forward_sync_buffers),
    ):
        if value is not None:
            _check_bool(name, value)
    if forward_sync_buffers is not None:
        return forward_sync_buffers, True
    effective = True if broadcast_buffers is None else broadcast_buffers
    return effective, effective


def _process_group(process_group: Any, device_mesh: Any) -> dist.ProcessGroup:
    """torch's rule: the default group, ``process_group``, or a 1-D ``device_mesh``'s group."""
    if process_group is not None and device_mesh is not None:
        raise RuntimeError("Cannot specify both process_group and device_mesh arguments.")
    if device_mesh is not None:
        if device_mesh.ndim != 1:
            raise RuntimeError(f"Only 1D device mesh is supported, but got {device_mesh}.")
        group: dist.ProcessGroup = device_mesh.get_group(mesh_dim=0)
        return group
    if process_group is not None:
        if process_group is dist.GroupMember.NON_GROUP_MEMBER:
            raise ValueError(
                "this rank is not in process_group: new_group(ranks) returns a placeholder on "
                "the ranks it leaves out. Wrap the model only on the group's ranks, or pass a "
                "group this rank belongs to (new_subgroups() gives every rank its own)"
            )
        if not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(
                f"process_group must be a torch.distributed.ProcessGroup, got {process_group!r}"
            )
        return process_group
    # torch types WORLD as optional: None before init_process_group, checked before this.
    world = dist.group.WORLD
    assert world is not None
    return world


def _pinned_bytes(bucket_cap_mb: float | None, bucket_size: int | None) -> int | None:
    if bucket_cap_mb is None:
        return bucket_size
    if bucket_size is not None:
        raise ValueError(
            "give bucket_size (bytes, distune's) or bucket_cap_mb (MiB, torch's), not both"
        )
    top = BUCKET_SIZE_2P_LIMITS[1]
    if (
        isinstance(bucket_cap_mb, bool)
        # numbers.Real: NumPy's scalars too (a value read from an array), as torch takes them.
        or not isinstance(bucket_cap_mb, numbers.Real)
        or not math.isfinite(bucket_cap_mb)
        or not 0 <= bucket_cap_mb * MIB <= 1 << top
    ):
        raise ValueError(
            f"bucket_cap_mb must be a number of MiB from 0 (one bucket per parameter) to "
            f"2**{top - 20} (256 TiB, the largest bucket), got {bucket_cap_mb!r}"
        )
    # torch's bucket_cap_mb=0 closes a bucket after every parameter: distune's 1-byte buckets.
    return max(1, round(bucket_cap_mb * MIB))


def _as_device(device: int | str | torch.device) -> torch.device:
    return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)


def _device_attributes(
    device: torch.device,
    device_ids: Sequence[int | str | torch.device] | None,
    output_device: int | str | torch.device | None,
) -> tuple[list[int] | None, int | None]:
    """torch's ``device_ids`` and ``output_device`` attributes, after checking that
    ``output_device`` is the module's device (a single-device module's outputs stay there)."""
    if output_device is not None and _as_device(output_device) != device:
        raise ValueError(
            f"output_device={output_device!r}, but the module is on {device}: a "
            "single-device module's outputs stay on its device (as in torch DDP); pass "
            "output_device=None or the module's device"
        )
    if device.type == "cpu" or not device_ids:
        return None, None
    index = device.index if device.index is not None else 0
    return [index], index


def _single_device(
    params: Sequence[torch.Tensor], device_ids: Sequence[int | str | torch.device] | None
) -> torch.device:
    devices = {p.device for p in params}
    if len(devices) != 1:
        raise ValueError(
            f"all parameters must be on one device, found {sorted(map(str, devices))}; "
            "distune averages single-device modules"
        )
    (device,) = devices
    if device_ids is None or len(device_ids) == 0:  # torch accepts [] as None
        return device
    if len(device_ids) != 1:
        raise ValueError(f"device_ids must list exactly one device, got {list(device_ids)}")
    if _as_device(device_ids[0]) != device:
        raise ValueError(
            f"device_ids={list(device_ids)} but the module's parameters are on {device}: move "
            "the module to that device first, or pass device_ids=None for a CPU module"
        )
    return device
