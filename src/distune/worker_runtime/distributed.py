"""``distune.DistributedDataParallel``: torch DDP's usage and arguments, tunable communication.

Construction, in order (collectives, so every rank runs the same steps): validate torch's
arguments (:mod:`.torch_ddp_arguments`), learn the topology (:mod:`.topology`), plan the starting
group (:mod:`.starting_group`), check that every rank wraps the same parameters and agree on
rank 0's starting group (:mod:`.consistency`), broadcast rank 0's parameters and buffers
(:mod:`.module_state`), build the reducer (:mod:`.reducer`) and, under ``distune-run
--autotune_level 1``, the sync points and the leader's HTTP thread (:mod:`.sync`,
:mod:`.leader_client`, named per :mod:`.model_names`). ``join()`` is :mod:`.join`.

Nothing here refers back to the wrapper (the reducer's hooks hold it weakly, the sync points
return decisions rather than call back), so a dropped wrapper is freed at once by reference
counting, on every rank alike, and its leader thread is closed.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from distune.errors import DistuneError
from distune.space import Hyperparameters
from distune.worker_runtime.algorithms import Algorithm, GradientAllReduce
from distune.worker_runtime.algorithms.base import ModelAverager
from distune.worker_runtime.algorithms.comm_hook import CommHook, CommHookExchange
from distune.worker_runtime.consistency import agree_on_model, agree_on_switch
from distune.worker_runtime.join import DistributedDataParallelJoinHook, forward_agreement
from distune.worker_runtime.leader_client import LeaderClient, check_model_name
from distune.worker_runtime.model_names import NAMES_IN_USE, tuning_name
from distune.worker_runtime.module_state import BufferBroadcast, broadcast_module_state
from distune.worker_runtime.optimizer_in_backward import InBackwardOptimizers
from distune.worker_runtime.reducer import Reducer
from distune.worker_runtime.starting_group import StartingGroup
from distune.worker_runtime.sync import SyncPoints
from distune.worker_runtime.topology import HierarchicalProcessGroups, Topology, discover
from distune.worker_runtime.torch_ddp_arguments import TorchDDPArguments
from distune.worker_runtime.trial_measurement import measure_wrapper_in_trial
from distune.worker_settings import WorkerSettings

logger = logging.getLogger(__name__)


class UnsupportedModuleError(DistuneError, ValueError):
    """A module, or a use of it, that torch's DDP accepts but distune cannot average as torch
    does (sparse embeddings, a DDP wrapper nested inside, torch's DDP around it averaging the
    same parameters, ``join()`` under a model-averaging algorithm or with
    ``divide_by_initial_world_size=False``, ZeroRedundancyOptimizer's overlap hooks, a
    ``grad_dtype`` other than the parameter's, SyncBatchNorm on CPU, DTensor parameters, or
    one torch refuses with a less helpful error: tensors on the meta device); the message
    names it and the way out."""


#: The module of torch's comm hooks that overlap ZeroRedundancyOptimizer with torch's reducer.
_ZERO_OVERLAP_HOOKS = "torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook"

#: What is not pickled (process groups, hooks, threads): rebuilt by ``__setstate__``.
_RUNTIME = (
    "process_group",
    "_reducer",
    "_sync",
    "_name_claim",
    "_buffer_broadcast",
    "_averager",
)


class DistributedDataParallel(nn.Module, Joinable):
    """Data-parallel wrapper whose gradient bucket size and allreduce shape can change online.

    Use it as ``torch.nn.parallel.DistributedDataParallel``: construct it after
    ``torch.distributed.init_process_group`` on every rank, call it for the forward, call
    ``backward()`` on the loss (it returns with gradients averaged over the ranks) and step the
    optimizer. Parameters and buffers are broadcast from rank 0 at construction, buffers again
    before a forward that follows an averaging one (torch's rule). The wrapped module is
    ``.module``, so ``state_dict()`` keys carry torch DDP's ``module.`` prefix.

    Args:
        module: the model; all its parameters on one device (CPU or one GPU).
        *args, **kwargs: torch DDP's arguments, positional in torch's order or by keyword, as
            the installed torch's ``DistributedDataParallel`` takes them (``device_ids``,
            ``output_device``, ``dim``, ``broadcast_buffers``, ``init_sync``,
            ``process_group``, ``bucket_cap_mb``, ``find_unused_parameters``,
            ``check_reduction``, ``gradient_as_bucket_view``, ``static_graph``, then torch
            2.13's ``delay_all_reduce_named_params``, ``param_to_hook_all_reduce``,
            ``device_mesh``, ``skip_all_reduce_unused_params``, ``batched_grad_copy``,
            ``forward_sync_buffers``): see :mod:`.torch_ddp_arguments` for what each does here
            and which are refused (``mixed_precision``, ``bucket_cap_mb_list``).
        name: the model's name for the tuning service (1-64 of ``[A-Za-z0-9._-]``, not ``.``
            or ``..``). Models given no name (or the default ``model0``) are tuned as
            ``model0``, ``model1``, ... in construction order; a name given to two live models
            is an error.
        bucket_size: pin the bucket size (bytes, rounded to a power of two); not tuned.
        hierarchical: pin hierarchical allreduce on or off; not tuned.
        algorithm: how the ranks' models are kept in step (:mod:`distune.algorithms`); default
            :class:`~distune.algorithms.GradientAllReduce`. Only the knobs the algorithm uses
            are tuned; the algorithm itself never changes. A copy of the wrapper (pickle,
            ``deepcopy``) averages gradients with ``GradientAllReduce``.

    Parameters and buffers named in ``module._ddp_params_and_buffers_to_ignore`` (torch's
    ``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model``) are neither
    averaged nor broadcast, as in torch.

    Under ``distune-run --autotune_level 1`` (``DISTUNE_SERVICE_URL`` set), the model tunes
    itself: see :mod:`distune.worker_runtime.sync`. Otherwise it keeps its starting group.
    """

    def __init__(
        self,
        module: nn.Module,
        *args: Any,
        name: str = "model0",
        bucket_size: int | None = None,
        hierarchical: bool | None = None,
        algorithm: Algorithm | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        Joinable.__init__(self)
        ignored = _ignored_names(module)
        named = _trainable(module, ignored)
        check_model_name(name)
        if hierarchical is not None and not isinstance(hierarchical, bool):
            raise TypeError(f"hierarchical must be True, False or None, got {hierarchical!r}")
        #: The algorithm keeping the ranks' models in step.
        self.algorithm = algorithm = _checked_algorithm(algorithm)
        arguments = TorchDDPArguments.bind(module, args, kwargs, [p for _, p in named], bucket_size)
        _refuse_cpu_sync_batch_norm(module, arguments.device)
        self.module = module
        self.name = name
        #: torch's group the gradients are averaged over (``None`` only in a copy loaded
        #: where torch.distributed is not initialized).
        self.process_group: dist.ProcessGroup | None = arguments.process_group
        process_group = arguments.process_group
        self.device = arguments.device
        self._set_torch_attributes(arguments, ignored)
        #: torch DDP's flag: False inside :meth:`no_sync`.
        self.require_backward_grad_sync = True
        #: Calls of :meth:`set_hyperparameters` so far (each is checked across the ranks).
        self._switch_calls = 0
        # Whether the first forward looked for torch's in-backward optimizers.
        self._in_backward_checked = False
        #: torch DDP's flag: whether the last forward averaged (the next one then broadcasts
        #: buffers); True before the first.
        self.require_forward_param_sync = True
        backend = str(dist.get_backend(process_group))
        # Small collectives (topology, sync points, join) need CUDA tensors under NCCL.
        self._comm_device = self.device if "nccl" in backend else torch.device("cpu")
        self.topology = self._discover_topology()
        settings = WorkerSettings.from_env()
        start = self._plan_start(named, arguments.bucket_size, hierarchical, settings)
        # An algorithm that uses neither knob has nothing to tune.
        tuning = settings.tuning and (algorithm.uses_bucket_size or algorithm.uses_hierarchical)
        agreement = agree_on_model(process_group, named, start.space.default, tuning)
        hyperparameters, tuning = agreement.hyperparameters, agreement.tuning
        if arguments.init_sync:
            broadcast_module_state(self._state_tensors(arguments.init_sync_buffers), process_group)
        process_groups = (
            HierarchicalProcessGroups.build(self.topology, process_group)
            if self.topology.hierarchical_possible
            else None
        )
        self._start_averaging(named)
        self._attach_runtime(named, hyperparameters, process_groups, algorithm)
        if tuning:
            self._start_tuning(settings, start, hyperparameters)
        self._log_start(len(named), start, tuning)
        if tuning and arguments.bucket_size is not None and not start.space.tuned:
            unpinned = self._plan_start(named, None, hierarchical, settings)
            if unpinned.space.tuned:
                self._warn_bucket_pin()
        # A level-2 trial of a script that never calls distune.prepare is measured here.
        measure_wrapper_in_trial(self, module, self._runtime())

    def _set_torch_attributes(self, arguments: TorchDDPArguments, ignored: frozenset[str]) -> None:
        """The attributes torch's DDP has, with the values torch would give them."""
        values = arguments.values
        self.device_ids = arguments.device_ids
        self.output_device = arguments.output_device
        self.dim: int = values.get("dim", 0)
        self.find_unused_parameters: bool = values.get("find_unused_parameters", False)
        self.gradient_as_bucket_view: bool = values.get("gradient_as_bucket_view", False)
        self.static_graph: bool = values.get("static_graph", False)
        #: Whether buffers are broadcast before forwards, by torch's rule (torch 2.13's name;
        #: ``broadcast_buffers`` reads and sets it too).
        self.forward_sync_buffers = arguments.forward_sync_buffers
        #: Names of the parameters and buffers neither averaged nor broadcast.
        self.parameters_to_ignore = set(ignored)

    @property
    def broadcast_buffers(self) -> bool:
        """torch's older name of :attr:`forward_sync_buffers`."""
        return self.forward_sync_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self.forward_sync_buffers = value

    def _state_tensors(self, buffers: bool) -> list[torch.Tensor]:
        """The parameters (and buffers if ``buffers``) copied between ranks: all but ignored."""
        ignored = self.parameters_to_ignore
        tensors: list[torch.Tensor] = [
            p for n, p in self.module.named_parameters() if n not in ignored
        ]
        if buffers:
            tensors += [b for n, b in self.module.named_buffers() if n not in ignored]
        return tensors

    def _plan_start(
        self,
        named: list[tuple[str, nn.Parameter]],
        bucket_size: int | None,
        hierarchical: bool | None,
        settings: WorkerSettings,
    ) -> StartingGroup:
        # A knob the algorithm does not use is pinned: tuning it would measure noise.
        if not self.algorithm.uses_bucket_size and bucket_size is None:
            bucket_size = settings.default_bucket_size
        if not self.algorithm.uses_hierarchical and hierarchical is None:
            hierarchical = False
        gradients = sum(p.numel() * p.element_size() for _, p in named)
        return StartingGroup.plan(self.topology, gradients, bucket_size, hierarchical, settings)

    def _start_averaging(self, named: list[tuple[str, nn.Parameter]]) -> None:
        """A model-averaging algorithm's averager (it may create process groups: collective)."""
        self._averager: ModelAverager | None = None
        if not self.algorithm.averages_gradients:
            params = [p for _, p in named]
            self._averager = self.algorithm.model_averager(params, self._process_group())
            self.require_backward_grad_sync = False  # gradients stay local
            self.require_forward_param_sync = False

    def _discover_topology(self) -> Topology:
        process_group = self._process_group()
        topology = discover(process_group, self._comm_device)
        spans_job = dist.get_world_size(process_group) == dist.get_world_size()
        if topology.hierarchical_possible and not spans_job:
            # Hierarchical groups are created by the whole job; a subgroup averages flat only.
            topology = topology.as_single_rank_nodes()
        return topology

    def _attach_runtime(
        self,
        named: list[tuple[str, nn.Parameter]],
        hyperparameters: Hyperparameters,
        process_groups: HierarchicalProcessGroups | None,
        algorithm: Algorithm | None = None,
    ) -> None:
        """The parts that hold process groups and hooks (rebuilt by ``__setstate__``)."""
        process_group = self._process_group()
        exchange = (
            None
            if algorithm is None or not algorithm.averages_gradients
            else partial(algorithm.gradient_exchange, process_group)
        )
        self._reducer: Reducer | None = Reducer(
            [p for _, p in named],
            [n for n, _ in named],
            process_group,
            hyperparameters,
            process_groups,
            self._comm_device,
            self.module,
            exchange,
            frozenset(self.parameters_to_ignore),
        )
        self._buffer_broadcast: BufferBroadcast | None = BufferBroadcast(
            self.module, process_group, frozenset(self.parameters_to_ignore)
        )
        self._sync: SyncPoints | None = None
        self._name_claim: object | None = None

    def _start_tuning(
        self, settings: WorkerSettings, start: StartingGroup, hyperparameters: Hyperparameters
    ) -> None:
        assert self._reducer is not None
        process_group = self._process_group()
        self.name = NAMES_IN_USE.name_for(self.name, self.module, process_group)
        session = tuning_name(self.name, process_group)
        shared_with = NAMES_IN_USE.sharing(self.module, self._reducer.params)
        if shared_with and self.topology.rank == 0:
            logger.warning(
                "model %r shares parameters with the live DistributedDataParallel %s of another "
                "module (tied weights): each is tuned under its own name, and a backward "
                "through both raises ReductionError (each would average the shared gradients, "
                "the second what the first is still averaging). Wrap one module holding both "
                "(an nn.ModuleDict), or, if this wrapper replaces the other, wrap the same "
                "module again (model.module) or drop the other first (del model)",
                self.name,
                " and ".join(repr(name) for name in shared_with),
            )
        client = None
        if self.topology.rank == 0:
            assert settings.service_url is not None
            client = LeaderClient(
                settings.service_url,
                settings.service_token,
                session,
                start.facts,
                start.pinned,
                start.space,
            )
        self._sync = SyncPoints(
            process_group, self._comm_device, client, hyperparameters, settings.sync_interval
        )
        claim = NAMES_IN_USE.claim(
            session, self.module, self._reducer.params, self._sync.stop, client
        )
        self._name_claim = claim
        self._reducer.on_iteration = self._sync.after_iteration
        if client is not None:
            client.start(after=claim.replaced)

    def _log_start(self, parameters: int, start: StartingGroup, tuning: bool) -> None:
        if self.topology.rank == 0:
            logger.info(
                "model %r: %d parameter(s), %d gradient bytes, %d node(s) x %d rank(s); starts "
                "on %s; %s",
                self.name,
                parameters,
                start.facts.gradient_bytes,
                self.topology.nnodes,
                self.topology.local_world_size,
                self.hyperparameters.describe(),
                "tuning online" if tuning else "not tuning",
            )

    def _warn_bucket_pin(self) -> None:
        """torch DDP scripts often pass ``bucket_cap_mb`` out of habit: under level 1 it pins
        the one knob this job could tune, and nothing is tuned; say so once."""
        if self.topology.rank == 0:
            logger.warning(
                "model %r: its constructor pins the bucket size (bucket_cap_mb or bucket_size), "
                "the only knob this job could tune: --autotune_level 1 measures one group and "
                "changes nothing; leave bucket_cap_mb out to let distune tune the bucket size",
                self.name,
            )

    # -- distune's own ---------------------------------------------------------------------

    @property
    def hyperparameters(self) -> Hyperparameters:
        """The group in use, as it runs: bucket size exponent and allreduce shape."""
        return self._runtime().hyperparameters

    def set_hyperparameters(self, hyperparameters: Hyperparameters) -> None:
        """Switch to ``hyperparameters`` before the next forward.

        A collective in effect: every rank must call it at the same iteration, with the same
        value, between iterations. If the model was tuning itself, tuning stops for it (on
        every rank at once, since all call this together): an explicit choice wins.
        Hierarchical allreduce where the topology has no use for it runs (and reads) flat.
        """
        if not isinstance(hyperparameters, Hyperparameters):
            raise TypeError(
                f"expected distune.Hyperparameters, got {type(hyperparameters).__name__}"
            )
        # Checked before anything changes: a rank left out would pair other buckets.
        call = self._switch_calls
        self._switch_calls += 1
        agree_on_switch(self._process_group(), self.name, call, hyperparameters)
        if self._sync is not None and not self._sync.stopped:
            logger.info("set_hyperparameters: model %r stops tuning", self.name)
            self._sync.stop()
        reducer = self._runtime()
        reducer.rebuild(hyperparameters)
        if reducer.hyperparameters != hyperparameters:
            logger.info(
                "set_hyperparameters: hierarchical allreduce on %d node(s) of %d rank(s) is "
                "flat allreduce: running %s",
                self.topology.nnodes,
                self.topology.local_world_size,
                reducer.hyperparameters.describe(),
            )

    def finish(self) -> None:
        """End of training on this rank. With a model-averaging algorithm, completes the
        averaging under way (``AsyncModelAverage``: returns once every rank has finished, all
        holding the same averaged model; ``Decentralized``: applies the last exchange); a no-op
        for gradient algorithms. Every rank calls it once, when it stops training."""
        if self._averager is not None:
            self._averager.finish()

    # -- torch DDP's -------------------------------------------------------------------------

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """As torch DDP's: average each gradient bucket with ``hook(state, bucket)``.

        ``hook`` returns a ``torch.futures.Future`` of the averaged bucket and receives the
        ranks' gradients summed, not averaged, so torch's ``fp16_compress_hook`` and PowerSGD's
        ``powerSGD_hook`` run unchanged (the bucket offers ``GradBucket``'s ``index``,
        ``buffer``, ``gradients``, ``parameters``, ``is_last`` and ``set_buffer``). Call it on
        every rank before training. A hook may keep state per bucket (PowerSGD does), so tuning
        stops for this model and its buckets keep their size.
        """
        if self._averager is not None or type(self.algorithm) is not GradientAllReduce:
            raise RuntimeError(
                f"a communication hook replaces the gradient allreduce, and {self.algorithm!r} "
                "already does something else: use the default algorithm (GradientAllReduce) "
                "with a hook"
            )
        if not callable(hook):
            raise TypeError(f"hook must be callable as hook(state, bucket), got {hook!r}")
        if getattr(hook, "__module__", None) == _ZERO_OVERLAP_HOOKS:
            raise UnsupportedModuleError(
                "ZeroRedundancyOptimizer(overlap_with_ddp=True)'s hooks (hook_with_zero_step, "
                "hook_with_zero_step_interleaved) step the optimizer inside torch's DDP reducer "
                "and read its bucket rebuilds, which distune's wrapper has not got: use "
                "ZeroRedundancyOptimizer without overlap_with_ddp (it steps after backward), "
                "or torch's DistributedDataParallel"
            )
        if self._sync is not None and not self._sync.stopped:
            if self.topology.rank == 0:  # the user asked for tuning: say why it stops
                logger.warning(
                    "register_comm_hook: model %r stops tuning and keeps %s (a hook may keep "
                    "state per bucket, as PowerSGD does, which a new bucket size would break)",
                    self.name,
                    self.hyperparameters.describe(),
                )
            self._sync.stop()
        process_group = self._process_group()
        self._runtime().set_exchange(
            lambda buckets, _: CommHookExchange(process_group, state, hook, buckets)
        )

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
        forward ran under :meth:`no_sync` or without gradients. Buffers are broadcast first by
        torch's rule (:meth:`_sync_buffers`). A second backward through this forward's output,
        after its gradients were averaged, raises (see :meth:`.Reducer.watch`)."""
        grad_enabled = torch.is_grad_enabled()
        reducer = self._runtime() if grad_enabled else None
        if reducer is not None:
            reducer.check_module(self.module)
            _refuse_outer_torch_ddp(reducer)
            if not self._in_backward_checked:
                self._take_over_in_backward_optimizers(reducer)
            if self._averager is not None:
                self._averager.before_forward()
        self._sync_buffers(grad_enabled)
        averages = grad_enabled and self.require_backward_grad_sync
        # torch's flag, read by the next forward: whether this one averages.
        self.require_forward_param_sync = averages
        if reducer is not None:
            reducer.prepare_for_forward(averages)
        output = self.module(*args, **kwargs)
        if reducer is not None and averages:
            reducer.watch(output)
        return output

    def _take_over_in_backward_optimizers(self, reducer: Reducer) -> None:
        """As torch's DDP, at the first forward: the optimizers torch's
        ``_apply_optimizer_in_backward`` gave the parameters by then step once their gradients
        are averaged (:mod:`.optimizer_in_backward`). Not under a model-averaging algorithm,
        which keeps gradients local: torch's hooks then stay."""
        self._in_backward_checked = True
        if self._averager is None:
            in_backward = InBackwardOptimizers.take_over(reducer.params)
            reducer.after_reduction = None if in_backward is None else in_backward.step

    def _sync_buffers(self, grad_enabled: bool) -> None:
        """Broadcast the buffers from rank 0 before a forward, by torch's rule: when the
        previous forward averaged (or this is the first), whatever this one does, so an
        evaluation forward after a training one sees rank 0's statistics and a ``no_sync``
        accumulation broadcasts at its first micro-batch. Under ``join()``: before each
        forward that averages, from a rank still training, agreed with the joined ranks,
        which shadow those forwards only (:mod:`.join`)."""
        broadcast = self._buffer_broadcast
        if self._join_config.enable:
            if not grad_enabled:
                return
            Join.notify_join_context(self)
            averages, source = forward_agreement(
                self._process_group(), self._comm_device, self.require_backward_grad_sync
            )
            if averages and self.forward_sync_buffers and broadcast is not None:
                broadcast(source)
        elif (
            self.require_forward_param_sync and self.forward_sync_buffers and broadcast is not None
        ):
            broadcast()

    def join(
        self,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
    ) -> Join:
        """torch DDP's context manager for uneven inputs: see :mod:`.join`."""
        self._check_joinable(divide_by_initial_world_size)
        return Join(
            [self],
            enable,
            throw_on_early_termination,
            divide_by_initial_world_size=divide_by_initial_world_size,
        )

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The hook ``torch.distributed.algorithms.join.Join`` runs on a joined rank."""
        self._check_joinable(kwargs.get("divide_by_initial_world_size", True))
        return DistributedDataParallelJoinHook(self)

    def _check_joinable(self, divide_by_initial_world_size: object) -> None:
        if self._averager is not None:
            raise UnsupportedModuleError(
                f"join() cannot shadow {self.algorithm!r}: its weight exchanges run at "
                "forwards, which a rank out of inputs has none of. Give every rank the same "
                "number of batches (e.g. DistributedSampler(drop_last=True)), or use a "
                "gradient algorithm (GradientAllReduce, LowPrecision) with join()"
            )
        if divide_by_initial_world_size is not True:
            raise UnsupportedModuleError(
                "divide_by_initial_world_size must be True: distune divides gradients before "
                "the sum, by the initial world size (torch's default); joined ranks add zeros"
            )

    def _set_static_graph(self) -> None:
        """torch's way to declare a static graph after construction: nothing to do here, as
        with ``static_graph=True`` (the bucket order is learned from the first backward)."""
        self.static_graph = True

    @property
    def join_device(self) -> torch.device:
        """Where join's collectives run."""
        return self._comm_device

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        """The group join's collectives run over."""
        return self._process_group()

    # -- copies --------------------------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        """As torch DDP: the state without process groups, hooks and threads (a copy made by
        ``copy.deepcopy``, ``pickle`` or ``torch.save`` averages over the default group, flat,
        with the same bucket size, and does not tune)."""
        state = {k: v for k, v in self.__dict__.items() if k not in _RUNTIME}
        reducer = self.__dict__.get("_reducer")
        state["_saved_hyperparameters"] = (
            state.get("_saved_hyperparameters") if reducer is None else reducer.hyperparameters
        )
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        # A copy saved before torch 2.13's names: broadcast_buffers was an attribute.
        state.setdefault("forward_sync_buffers", state.pop("broadcast_buffers", True))
        state.setdefault("parameters_to_ignore", set())
        state.setdefault("require_forward_param_sync", True)
        state.setdefault("_switch_calls", 0)
        super().__setstate__(state)
        self._in_backward_checked = False  # the copy's own reducer looks at its first forward
        self.process_group = None
        self._reducer = self._sync = self._name_claim = None
        self._buffer_broadcast = self._averager = None
        self.algorithm = GradientAllReduce()
        if dist.is_available() and dist.is_initialized():
            self.process_group = _default_process_group()
            saved: Hyperparameters = state["_saved_hyperparameters"]
            self._attach_runtime(
                _trainable(self.module, frozenset(self.parameters_to_ignore)),
                Hyperparameters(saved.bucket_size_2p, False),
                None,
            )

    def _process_group(self) -> dist.ProcessGroup:
        if self.process_group is None:
            self._runtime()  # raises: a copy loaded where torch.distributed is not initialized
        assert self.process_group is not None
        return self.process_group

    def _runtime(self) -> Reducer:
        if self._reducer is None:
            raise RuntimeError(
                "this DistributedDataParallel was loaded where torch.distributed is not "
                "initialized: it can run forwards without gradients (inference); to train, "
                "call init_process_group first, or load and wrap its .module"
            )
        return self._reducer


def _default_process_group() -> dist.ProcessGroup:
    # torch types WORLD as optional: None before init_process_group, checked before this.
    world = dist.group.WORLD
    assert world is not None
    return world


def _ignored_names(module: nn.Module) -> frozenset[str]:
    """Names torch's ``_set_params_and_buffers_to_ignore_for_model`` set on ``module``."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    return frozenset(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))


def _trainable(module: nn.Module, ignored: frozenset[str]) -> list[tuple[str, nn.Parameter]]:
    """The parameters averaged: trainable and not ignored, each once (shared ones too).

    Refused here, before any collective, as torch refuses them: a module with nothing to
    average, uninitialized (lazy) parameters, parameters or buffers on the meta device,
    DTensor parameters, and sparse embeddings (distune's buckets are dense)."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "distune.DistributedDataParallel needs torch.distributed to be initialized: call "
            "torch.distributed.init_process_group(backend='gloo' or 'nccl') first "
            "(distune-run and torchrun set the environment it reads)"
        )
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad and n not in ignored]
    lazy = [n for n, p in named if isinstance(p, nn.parameter.UninitializedParameter)]
    if lazy:
        raise RuntimeError(
            f"parameters {lazy[:5]} are uninitialized (lazy modules): run a forward through "
            "the module once before wrapping it, as torch DDP requires"
        )
    _refuse_meta(module, ignored)
    _refuse_dtensors(named)
    _refuse_sparse(module, ignored)
    _refuse_nested(module)
    _refuse_grad_dtype(named)
    if not named:
        raise ValueError(
            "the module has no parameter that requires a gradient: there is nothing to "
            "average, so it needs no DistributedDataParallel"
        )
    return named


def _refuse_meta(module: nn.Module, ignored: frozenset[str]) -> None:
    # torch's DDP fails on them at construction too. Wrapped, they would be replaced by
    # to_empty() (then not averaged: the next forward raises), or never hold a value at all.
    tensors = [*module.named_parameters(), *module.named_buffers()]
    meta = [name for name, tensor in tensors if tensor.is_meta and name not in ignored]
    if meta:
        raise UnsupportedModuleError(
            f"parameters or buffers {meta[:5]} are on the meta device (not materialised): "
            "materialise the module before wrapping it (module.to_empty(device=...), then "
            "initialise or load its weights), as torch's DDP requires"
        )


def _refuse_outer_torch_ddp(reducer: Reducer) -> None:
    """Refuse a forward that torch's DDP runs (``model = DDP(distune_model)``, or a framework
    that wraps whatever it is given: Accelerate, Lightning, Hugging Face's Trainer) when that
    DDP averages parameters this wrapper averages too: the two engines would each average
    them, racing (on 2 gloo ranks some gradients came out halved). torch sets the DDP whose
    forward is running; one that ignores these parameters (TorchRec's nesting) is fine."""
    outer = torch.nn.parallel.DistributedDataParallel._get_active_ddp_module()
    if outer is None:
        return
    ours = {id(p) for p in reducer.params}
    ignored: set[str] = getattr(outer, "parameters_to_ignore", set())
    for name, param in outer.module.named_parameters():
        if id(param) in ours and param.requires_grad and name not in ignored:
            raise UnsupportedModuleError(
                f"this distune.DistributedDataParallel runs inside torch's "
                f"DistributedDataParallel, which averages its parameters too ({name!r}): "
                "both would average every gradient, racing each other. Wrap the model once: "
                "give a framework that wraps models itself (Accelerate's prepare, Lightning's "
                "DDP strategy, Hugging Face's Trainer) the bare model (.module), or use "
                "distune's wrapper alone"
            )


def _refuse_dtensors(named: list[tuple[str, nn.Parameter]]) -> None:
    # Tensor-parallel or FSDP2-sharded parameters: the construction broadcast failed on them
    # with DTensor's "c10d.broadcast_.default does not have a sharding strategy registered".
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # an older torch, where it was private
        from torch.distributed._tensor import DTensor
    for name, param in named:
        if isinstance(param, DTensor):
            raise UnsupportedModuleError(
                f"parameter {name!r} is a DTensor (tensor parallelism or FSDP2 sharding): "
                "distune's buckets average plain tensors. For data parallelism over "
                "tensor-parallel shards use torch's DistributedDataParallel with "
                "device_mesh=mesh['dp'] (torch's 2-D recipe)"
            )


def _refuse_nested(module: nn.Module) -> None:
    for prefix, sub in module.named_modules():
        if isinstance(sub, DistributedDataParallel | torch.nn.parallel.DistributedDataParallel):
            where = f"submodule {prefix!r}" if prefix else "the module"
            raise UnsupportedModuleError(
                f"{where} is already a {type(sub).__module__}.{type(sub).__name__}: nested "
                "wrappers would average its gradients twice, racing each other. Wrap the bare "
                "model once (the inner wrapper's .module)"
            )


def _refuse_cpu_sync_batch_norm(module: nn.Module, device: torch.device) -> None:
    # torch's DDP refuses them at construction too; their forward would fail on CPU tensors.
    if device.type == "cpu":
        for prefix, sub in module.named_modules():
            if isinstance(sub, nn.SyncBatchNorm):
                raise UnsupportedModuleError(
                    f"submodule {prefix!r} is a SyncBatchNorm, which works with GPU modules "
                    "only (torch's DDP refuses it on CPU too): use nn.BatchNorm* on CPU, with "
                    "buffers broadcast from rank 0 as torch's DDP does"
                )


def _refuse_grad_dtype(named: list[tuple[str, nn.Parameter]]) -> None:
    # torch 2.13's Tensor.grad_dtype: a gradient of another dtype than its parameter's.
    for name, param in named:
        grad_dtype = getattr(param, "grad_dtype", param.dtype)
        if grad_dtype is not None and grad_dtype != param.dtype:
            raise UnsupportedModuleError(
                f"parameter {name!r} has grad_dtype={grad_dtype}, not its own dtype "
                f"{param.dtype}: distune's buckets hold each gradient in its parameter's dtype "
                "(torch's DDP refuses it too). Leave grad_dtype at the parameter's dtype, or "
                "keep the parameters in the wider dtype and run the forward under torch.autocast"
            )


def _refuse_sparse(module: nn.Module, ignored: frozenset[str]) -> None:
    for prefix, sub in module.named_modules():
        if isinstance(sub, nn.Embedding | nn.EmbeddingBag) and sub.sparse:
            name = f"{prefix}.weight" if prefix else "weight"
            if sub.weight.requires_grad and name not in ignored:
                where = f"submodule {prefix!r}" if prefix else "the module"
                raise UnsupportedModuleError(
                    f"{where} is an {type(sub).__name__} with sparse=True: "
                    "distune averages dense gradients only (its buckets are flat dense "
                    "buffers); use sparse=False, or torch's DistributedDataParallel for "
                    "sparse gradients"
                )


def _checked_algorithm(algorithm: Algorithm | None) -> Algorithm:
    if algorithm is None:
        return GradientAllReduce()
    if not isinstance(algorithm, Algorithm):
        raise TypeError(
            "algorithm must be one of distune.algorithms (GradientAllReduce, LowPrecision, "
            f"Decentralized, AsyncModelAverage), got {algorithm!r}"
        )
    return algorithm
