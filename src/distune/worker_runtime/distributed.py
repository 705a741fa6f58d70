"""``distune.DistributedDataParallel``: torch DDP's common usage, with tunable communication.

Which group a model starts on (the same rule the service applies, so the job runs the service's
default group before any HTTP answer arrives):

1. a constructor argument that is not ``None`` (``bucket_size`` in bytes, ``hierarchical``) pins
   that knob for this model; the leader sends it to the service as register's ``fixed``;
2. otherwise ``DISTUNE_BUCKET_SIZE`` / ``DISTUNE_HIERARCHICAL_REDUCE`` pin it job-wide (the
   launcher gives the service the same knobs as ``--fixed``);
3. the rest comes from ``SearchSpace.for_model(facts, fixed, DISTUNE_DEFAULT_BUCKET_SIZE).default``.

Bucket sizes in bytes are rounded to the nearest power of two (``space.bucket_size_2p_for``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from distune.space import (
    FixedKnobs,
    Hyperparameters,
    ModelFacts,
    SearchSpace,
    bucket_size_2p_for,
)
from distune.worker_runtime.leader_client import LeaderClient, check_model_name
from distune.worker_runtime.reducer import Reducer
from distune.worker_runtime.sync import SyncPoints
from distune.worker_runtime.topology import HierarchicalGroups, Topology, discover
from distune.worker_settings import WorkerSettings

logger = logging.getLogger(__name__)

#: Largest single broadcast when syncing module state at construction.
_BROADCAST_CHUNK_BYTES = 64 * 2**20


class DistributedDataParallel(nn.Module):
    """Data-parallel wrapper whose gradient bucket size and allreduce shape can change online.

    Use it as ``torch.nn.parallel.DistributedDataParallel``: construct it after
    ``torch.distributed.init_process_group`` on every rank, call it for the forward, call
    ``backward()`` on the loss (it returns with gradients averaged over the ranks) and step the
    optimizer. Parameters and buffers are broadcast from rank 0 at construction. The wrapped
    module is ``.module``, so ``state_dict()`` keys carry torch DDP's ``module.`` prefix.

    Args:
        module: the model; all its parameters on one device (CPU or one GPU).
        name: the model's name for the tuning service (1-64 of ``[A-Za-z0-9._-]``); give each
            wrapped model of a job its own.
        bucket_size: pin the bucket size (bytes, rounded to a power of two); not tuned.
        hierarchical: pin hierarchical allreduce on or off; not tuned.
        process_group: the group to average over (default: the whole job).
        device_ids: as torch DDP's: ``None`` for CPU modules, ``[device]`` for a GPU module
            (its parameters must already be on that device).

    Under ``distune-run --autotune_level 1`` (``DISTUNE_SERVICE_URL`` set), the model tunes
    itself: see :mod:`distune.worker_runtime.sync`. Otherwise it keeps its starting group.
    """

    def __init__(
        self,
        module: nn.Module,
        name: str = "model0",
        bucket_size: int | None = None,
        hierarchical: bool | None = None,
        process_group: dist.ProcessGroup | None = None,
        device_ids: Sequence[int | torch.device] | None = None,
    ) -> None:
        super().__init__()
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "distune.DistributedDataParallel needs torch.distributed to be initialized: call "
                "torch.distributed.init_process_group(backend='gloo' or 'nccl') first "
                "(distune-run and torchrun set the environment it reads)"
            )
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        check_model_name(name)
        if hierarchical is not None and not isinstance(hierarchical, bool):
            raise TypeError(f"hierarchical must be True, False or None, got {hierarchical!r}")
        settings = WorkerSettings.from_env()
        self.module = module
        self.name = name
        self.process_group = dist.group.WORLD if process_group is None else process_group
        #: torch DDP's flag: False inside :meth:`no_sync`.
        self.require_backward_grad_sync = True

        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError(
                "the module has no parameter that requires a gradient: there is nothing to "
                "average, so it needs no DistributedDataParallel"
            )
        device = _single_device([p for _, p in named], device_ids)
        backend = str(dist.get_backend(self.process_group))
        # Small collectives (topology, sync points) need CUDA tensors under NCCL.
        self._comm_device = device if "nccl" in backend else torch.device("cpu")

        _broadcast_state(module, self.process_group)
        topology = discover(self.process_group, self._comm_device)
        spans_job = dist.get_world_size(self.process_group) == dist.get_world_size()
        if topology.hierarchical_possible and not spans_job:
            # Hierarchical groups are created by the whole job; a subgroup averages flat only.
            topology = topology.as_single_rank_nodes()
        gradient_bytes = sum(p.numel() * p.element_size() for _, p in named)
        facts = ModelFacts(
            topology.world_size, topology.nnodes, topology.local_world_size, gradient_bytes
        )
        pinned = FixedKnobs(
            None if bucket_size is None else bucket_size_2p_for(bucket_size), hierarchical
        )
        fixed = FixedKnobs(
            _first(
                pinned.bucket_size_2p,
                None if settings.bucket_size is None else bucket_size_2p_for(settings.bucket_size),
            ),
            _first(pinned.is_hierarchical_reduce, settings.hierarchical_reduce),
        )
        space = SearchSpace.for_model(facts, fixed, settings.default_bucket_size)
        if fixed.is_hierarchical_reduce and not topology.hierarchical_possible:
            logger.info(
                "hierarchical allreduce asked for, but with %d node(s) of %d rank(s) it is flat "
                "allreduce: running flat",
                topology.nnodes,
                topology.local_world_size,
            )
        self.topology: Topology = topology
        groups = (
            HierarchicalGroups.build(topology, self.process_group)
            if topology.hierarchical_possible
            else None
        )
        self._reducer = Reducer(
            [p for _, p in named],
            [n for n, _ in named],
            self.process_group,
            space.default,
            groups,
            self._comm_device,
        )
        self._sync: SyncPoints | None = None
        if settings.tuning:
            client = None
            if topology.rank == 0:
                assert settings.service_url is not None
                client = LeaderClient(
                    settings.service_url, settings.service_token, name, facts, pinned, space
                )
                client.start()
            self._sync = SyncPoints(
                self.process_group,
                self._comm_device,
                client,
                space.default,
                settings.sync_interval,
                self._reducer.rebuild,
            )
            self._reducer.on_iteration = self._sync.after_iteration
        if topology.rank == 0:
            logger.info(
                "model %r: %d parameter(s), %d gradient bytes, %d node(s) x %d rank(s); starts "
                "on %s; %s",
                name,
                len(named),
                gradient_bytes,
                topology.nnodes,
                topology.local_world_size,
                space.default.describe(),
                "tuning online" if settings.tuning else "not tuning",
            )

    @property
    def hyperparameters(self) -> Hyperparameters:
        """The group in use: bucket size exponent and allreduce shape."""
        return self._reducer.hyperparameters

    def set_hyperparameters(self, hyperparameters: Hyperparameters) -> None:
        """Switch to ``hyperparameters`` before the next forward.

        A collective in effect: every rank must call it at the same iteration, with the same
        value, between iterations. If the model was tuning itself, tuning stops for it (on
        every rank at once, since all call this together): an explicit choice wins.
        """
        if not isinstance(hyperparameters, Hyperparameters):
            raise TypeError(
                f"expected distune.Hyperparameters, got {type(hyperparameters).__name__}"
            )
        if self._sync is not None and not self._sync.stopped:
            logger.info("set_hyperparameters: model %r stops tuning", self.name)
            self._sync.stop()
        self._reducer.rebuild(hyperparameters)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: backward passes whose forward ran inside this context
        do not average; the first one after it averages everything accumulated."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped module; gradients of the coming backward are averaged unless the
        forward ran under :meth:`no_sync`."""
        if torch.is_grad_enabled():
            self._reducer.prepare_for_forward(self.require_backward_grad_sync)
        return self.module(*args, **kwargs)


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def _single_device(
    params: list[torch.Tensor], device_ids: Sequence[int | torch.device] | None
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
    (wanted,) = device_ids
    wanted = torch.device("cuda", wanted) if isinstance(wanted, int) else torch.device(wanted)
    if device != wanted:
        raise ValueError(
            f"device_ids={list(device_ids)} but the module's parameters are on {device}: move "
            "the module to that device first, or pass device_ids=None for a CPU module"
        )
    return device


def _chunks(tensors: list[torch.Tensor], limit: int) -> Iterator[list[torch.Tensor]]:
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
def _broadcast_state(module: nn.Module, process_group: dist.ProcessGroup) -> None:
    """Copy rank 0's parameters and buffers to every rank, a few large broadcasts per dtype."""
    if dist.get_world_size(process_group) == 1:
        return
    src = dist.get_global_rank(process_group, 0)
    by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for tensor in [*module.parameters(), *module.buffers()]:
        if tensor.numel() > 0:
            by_kind.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    for group in by_kind.values():
        for chunk in _chunks(group, _BROADCAST_CHUNK_BYTES):
            flat = torch.cat([t.reshape(-1) for t in chunk])
            dist.broadcast(flat, src=src, group=process_group)
            offset = 0
            for tensor in chunk:
                tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
                offset += tensor.numel()
