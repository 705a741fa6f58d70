"""torch DDP's constructor arguments, as distune's wrapper takes them.

Each one either does what it does in ``torch.nn.parallel.DistributedDataParallel`` or has no
work to do here, for the reason given beside it (README, "Differences from torch DDP"):

* ``device_ids``, ``output_device``: the module sits on one device; outputs stay there, which is
  what torch does for a single-device module. Given, they must name that device.
* ``dim``: where torch's single-process multi-device mode splits inputs; it has no effect on a
  single-device module, in torch as here.
* ``broadcast_buffers``: buffers are broadcast from rank 0 before each forward that averages.
* ``init_sync``: whether construction broadcasts rank 0's parameters and buffers.
* ``process_group``: the ranks gradients are averaged over.
* ``bucket_cap_mb``: pins the bucket size (MiB, rounded to a power of two of bytes); not tuned.
* ``find_unused_parameters``: unused parameters are always handled, at no cost when all are used.
* ``gradient_as_bucket_view``: gradients are always views of the buckets (no copy, no memory).
* ``static_graph``: the bucket order is learned from the first backward, which is what a static
  graph allows torch to do; reentrant checkpointing is handled without it.
* ``check_reduction``: deprecated in torch and ignored there too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

#: Bytes in one of ``bucket_cap_mb``'s megabytes (torch counts MiB).
MIB = 2**20


@dataclass(frozen=True)
class TorchDDPArguments:
    """What distune takes from torch DDP's arguments: the device gradients live on, whether to
    broadcast buffers each forward and parameters at construction, and a pinned bucket size
    in bytes (``None``: not pinned)."""

    device: torch.device
    broadcast_buffers: bool
    init_sync: bool
    bucket_size: int | None

    @classmethod
    def check(
        cls,
        params: Sequence[torch.Tensor],
        *,
        device_ids: Sequence[int | str | torch.device] | None,
        output_device: int | str | torch.device | None,
        dim: int,
        broadcast_buffers: bool,
        init_sync: bool,
        bucket_cap_mb: float | None,
        bucket_size: int | None,
        flags: dict[str, bool],
    ) -> TorchDDPArguments:
        """Validate torch's arguments for a module with ``params``; ``flags`` are the boolean
        arguments that need no work here (``find_unused_parameters`` and the like)."""
        device = _single_device(params, device_ids)
        if output_device is not None and _as_device(output_device) != device:
            raise ValueError(
                f"output_device={output_device!r}, but the module is on {device}: a "
                "single-device module's outputs stay on its device (as in torch DDP); pass "
                "output_device=None or the module's device"
            )
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise TypeError(f"dim must be an int, got {dim!r}")
        for name, value in {
            "broadcast_buffers": broadcast_buffers,
            "init_sync": init_sync,
            **flags,
        }.items():
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be True or False, got {value!r}")
        return cls(device, broadcast_buffers, init_sync, _pinned_bytes(bucket_cap_mb, bucket_size))


def _pinned_bytes(bucket_cap_mb: float | None, bucket_size: int | None) -> int | None:
    if bucket_cap_mb is None:
        return bucket_size
    if bucket_size is not None:
        raise ValueError(
            "give bucket_size (bytes, distune's) or bucket_cap_mb (MiB, torch's), not both"
        )
    if (
        isinstance(bucket_cap_mb, bool)
        or not isinstance(bucket_cap_mb, int | float)
        or not math.isfinite(bucket_cap_mb)
        or bucket_cap_mb <= 0
    ):
        raise ValueError(f"bucket_cap_mb must be a positive number of MiB, got {bucket_cap_mb!r}")
    return max(1, round(bucket_cap_mb * MIB))


def _as_device(device: int | str | torch.device) -> torch.device:
    return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)


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
    if device_ids is None:
        return device
    if len(device_ids) != 1:
        raise ValueError(f"device_ids must list exactly one device, got {list(device_ids)}")
    if _as_device(device_ids[0]) != device:
        raise ValueError(
            f"device_ids={list(device_ids)} but the module's parameters are on {device}: move "
            "the module to that device first, or pass device_ids=None for a CPU module"
        )
    return device
