"""Bucketed gradient averaging that overlaps backward: flat or hierarchical allreduce.

Each parameter's ``post_accumulate_grad`` hook marks it ready; a full bucket is divided by the
world size and allreduced asynchronously while backward goes on, buckets in one fixed order on
every rank so the collectives pair up. An autograd callback at the end of backward launches
what is left (parameters that got no gradient, handled as torch DDP's
``find_unused_parameters=True``) and waits, so ``backward()`` returns with averaged gradients.
After the first backward, buckets are rebuilt in rank 0's order of readiness.
docs/worker_runtime.md ("Buckets and gradients", "One backward", "Unused parameters") has
the rules and the reasons; they are written there once.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from distune.errors import DistuneError
from distune.space import Hyperparameters
from distune.worker_runtime.added_parameters import AddedParameterWatch
from distune.worker_runtime.algorithms.base import GradientExchange
from distune.worker_runtime.buckets import Bucket, Slot, assign_buckets
from distune.worker_runtime.forward_outputs import WatchedForward, accumulates_from, tensors_in
from distune.worker_runtime.topology import HierarchicalProcessGroups

logger = logging.getLogger(__name__)

#: Gradients of at least this many elements are divided while copied into their bucket.
FUSED_DIVISION_MIN_NUMEL = 4096

#: The attribute of a bucket's flat tensor holding its reducer, weakly: a gradient that is a
#: view of another reducer's bucket tells whose it is.
_OWNER = "_distune_reducer"


class ReductionError(DistuneError, RuntimeError):
    """Gradients cannot be averaged as asked; the message names the parameters concerned."""


class _FlatAllreduce:
    """One allreduce per bucket over the whole process group."""

    def __init__(self, process_group: dist.ProcessGroup) -> None:
        self._process_group = process_group

    def start(self, flat: torch.Tensor) -> Any:
        # On CUDA, NCCL's stream waits for the current stream (where the gradient was made).
        return dist.all_reduce(flat, group=self._process_group, async_op=True)

    def finish(self, handles: list[Any]) -> None:
        # gloo: blocks the host until done. NCCL: makes the current stream wait.
        for work in handles:
            work.wait()


class _HierarchicalAllreduce:
    """Reduce to the node leader, allreduce among leaders, broadcast from the leader.

    The three steps of a bucket are chained, and each process group must see its collectives in
    the same order on every rank. On CUDA the chain is enqueued on a side stream whose waits are
    stream waits, so enqueueing never blocks. On CPU (gloo) each step blocks the host until done,
    so the chains run in one worker thread, bucket after bucket in launch order.
    """

    def __init__(self, process_groups: HierarchicalProcessGroups, device: torch.device) -> None:
        self._process_groups = process_groups
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._executor = (
            ThreadPoolExecutor(1, thread_name_prefix="distune-hierarchical")
            if self._stream is None
            else None
        )
        self._failure: BaseException | None = None

    def _chain(self, flat: torch.Tensor) -> None:
        # After a failed step (a peer node lost), the queued chains must not start: their first
        # collective would wait for a peer stuck in the failed chain until the process group's
        # timeout, and the interpreter joins this thread before a failed rank can exit.
        if self._failure is not None:
            raise ReductionError(f"skipped: an earlier bucket failed ({self._failure})")
        process_groups = self._process_groups
        try:
            dist.reduce(flat, dst=process_groups.leader, group=process_groups.intra)
            if process_groups.leaders is not None:
                dist.all_reduce(flat, group=process_groups.leaders)
            dist.broadcast(flat, src=process_groups.leader, group=process_groups.intra)
        except BaseException as error:
            self._failure = error
            raise

    def start(self, flat: torch.Tensor) -> Future[None] | None:
        if self._executor is not None:
            return self._executor.submit(self._chain, flat)
        assert self._stream is not None
        self._stream.wait_stream(torch.cuda.current_stream(flat.device))
        with torch.cuda.stream(self._stream):
            self._chain(flat)
        return None

    def finish(self, handles: list[Any]) -> None:
        if self._stream is not None:
            torch.cuda.current_stream(self._stream.device).wait_stream(self._stream)
            return
        for future in handles:
            future.result()

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False)


def _on_grad_ready(reducer_ref: weakref.ref[Reducer], index: int, param: torch.Tensor) -> None:
    # A weak reference, so a dropped wrapper leaves no live hook behind (see Reducer.__init__).
    reducer = reducer_ref()
    if reducer is not None:
        reducer._grad_ready(index)


def _on_output_grad(
    reducer_ref: weakref.ref[Reducer], forward: WatchedForward, grad: torch.Tensor
) -> None:
    reducer = reducer_ref()
    if reducer is not None:
        reducer._output_reached(forward)


def _release(handles: list[Any], hierarchical: _HierarchicalAllreduce | None) -> None:
    for handle in handles:
        handle.remove()
    if hierarchical is not None:
        hierarchical.close()


def _enclosing_node() -> Any:
    """The node of an enclosing backward that autograd is running on this thread, or ``None``:
    in the end-of-backward callback of a backward nested in another (reentrant checkpointing),
    the node whose backward ran the nested one."""
    return torch._C._current_autograd_node()


def _buckets_of(reducer_ref: weakref.ref[Reducer]) -> Callable[[], list[Bucket]]:
    # Weakly, like the hooks: an exchange must not keep a dropped wrapper's reducer alive.
    def buckets() -> list[Bucket]:
        reducer = reducer_ref()
        return [] if reducer is None else reducer._buckets

    return buckets


#: Makes an algorithm's gradient exchange, given the reducer's buckets (in launch order) and
#: the hierarchical process groups (or ``None``); ``None``: the reducer's own allreduce.
ExchangeFactory = Callable[
    [Callable[[], Sequence[Bucket]], HierarchicalProcessGroups | None], GradientExchange | None
]

#: What runs after each synchronised backward: given the iteration count, the hyperparameters
#: to switch to before the next forward, or ``None`` to keep the current ones.
IterationHook = Callable[[int], Hyperparameters | None]


class Reducer:
    """Averages the gradients of ``params`` over ``process_group`` during each backward.

    ``names[i]`` names ``params[i]`` in error messages. ``process_groups`` are the hierarchical
    process groups, or ``None`` where the topology has no use for them (hierarchical then runs
    flat, which it is equivalent to, and :attr:`hyperparameters` says flat). ``device`` is where
    small collectives run (CUDA for NCCL). ``module``, when given, is the module ``params`` came
    from: if it later holds a trainable parameter the reducer does not average (a submodule
    replaced after wrapping), the next backward that leaves a parameter without gradient raises;
    so does the next averaged backward after a parameter frozen at construction is unfrozen.
    ``ignored`` names the module's parameters that are deliberately not averaged (torch's
    ``_ddp_params_and_buffers_to_ignore``).

    A backward is averaged only if a forward armed the reducer (:meth:`prepare_for_forward`
    outside ``no_sync``) since the last averaged backward, as torch DDP's reducer expects its
    hooks only after its own forward: a backward through the bare module, or through another
    wrapper of the same parameters, leaves these gradients alone.
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        names: Sequence[str],
        process_group: dist.ProcessGroup,
        hyperparameters: Hyperparameters,
        process_groups: HierarchicalProcessGroups | None,
        device: torch.device,
        module: torch.nn.Module | None = None,
        exchange: ExchangeFactory | None = None,
        ignored: frozenset[str] = frozenset(),
    ) -> None:
        self._params = list(params)
        self._names = list(names)
        self._process_group = process_group
        self._world_size = dist.get_world_size(process_group)
        self._device = device
        self._module = None if module is None else weakref.ref(module)
        self._ignored = ignored
        # The module's parameters frozen at construction, not averaged: one unfrozen later
        # would train without averaging (checked after each averaged backward, cheaply).
        known = {id(p) for p in self._params}
        self._frozen = (
            []
            if module is None
            else [
                p for n, p in module.named_parameters() if id(p) not in known and n not in ignored
            ]
        )
        # Parameters and submodules registered later (see check_module).
        self._added = None if module is None else AddedParameterWatch(module)
        self._sizes = [p.numel() * p.element_size() for p in self._params]
        self._keys = [(p.dtype, p.device) for p in self._params]
        # Launch order guess until the first backward tells: reverse registration order.
        self._order = list(reversed(range(len(self._params))))
        self._order_known = False
        # On CPU, the gradient tensors autograd hands over are kept until the next forward,
        # as long as torch DDP keeps them (as .grad until zero_grad). Freed in the middle of
        # backward instead, glibc hands the large ones back to the kernel and the next step
        # faults every page in again: ~5,000 minor faults and ~10 ms of CPU per step on the
        # 15M-parameter benchmark MLP. CUDA's caching allocator has no such cost.
        self._keep_spares = self._params[0].device.type == "cpu"
        self._spares: list[torch.Tensor] = []
        self._lock = threading.Lock()
        #: Whether the coming backward averages gradients (a forward outside no_sync armed it).
        self.armed = False
        # Watched forwards whose output no backward reached yet (see watch), and whether that
        # was reported; the nodes of outputs the running backward reached before any parameter.
        self._unreached = 0
        self._reported_unreached = False
        # Whether a forward with gradients ran through the wrapper since the last averaged
        # backward; a parameter's gradient seen without one is logged once (_note_local).
        self._forwarded = False
        self._reported_local = False
        self._local_check: int | None = None  # the parameter _report_local looks at
        self._reached_nodes: list[Any] = []
        #: Synchronised backward passes completed: the iteration count sync points refer to.
        self.iterations = 0
        #: Runs after each synchronised backward, outside the lock (see :data:`IterationHook`).
        self.on_iteration: IterationHook | None = None
        #: Runs once the gradients of a synchronised backward are averaged, before it returns
        #: (torch's in-backward optimizers: :mod:`.optimizer_in_backward`).
        self.after_reduction: Callable[[], None] | None = None
        self._flat = _FlatAllreduce(process_group)
        self._hierarchical = (
            _HierarchicalAllreduce(process_groups, self._params[0].device)
            if process_groups is not None
            else None
        )
        #: An algorithm's exchange of buckets, in place of the flat/hierarchical allreduce.
        self._exchange = (
            None if exchange is None else exchange(_buckets_of(weakref.ref(self)), process_groups)
        )
        self._build(hyperparameters)
        self._reset_backward_state()
        handles = [
            p.register_post_accumulate_grad_hook(partial(_on_grad_ready, weakref.ref(self), i))
            for i, p in enumerate(self._params)
        ]
        weakref.finalize(self, _release, handles, self._hierarchical)

    # -- configuration ---------------------------------------------------------------------

    @property
    def hyperparameters(self) -> Hyperparameters:
        """The group the buckets are built for, as it runs: hierarchical only where the
        topology has hierarchical process groups."""
        return self._hyperparameters

    @property
    def bucket_sizes(self) -> list[int]:
        """Gradient bytes of each bucket, in launch order."""
        return [bucket.nbytes for bucket in self._buckets]

    @property
    def params(self) -> list[torch.Tensor]:
        """The parameters averaged, in registration order."""
        return list(self._params)

    def rebuild(self, hyperparameters: Hyperparameters) -> None:
        """Rebuild the buckets (and pick the allreduce shape) for ``hyperparameters``.

        Between iterations only; the gradients held so far move into the new buckets, so a
        switch in the middle of ``no_sync`` accumulation loses nothing.
        """
        with self._lock:
            self._check_idle("change hyperparameters")
            self._build(hyperparameters)
            self._reset_backward_state()

    def _build(self, hyperparameters: Hyperparameters) -> None:
        layout = assign_buckets(self._sizes, self._keys, self._order, hyperparameters.bucket_size)
        self._buckets = [Bucket([self._params[i] for i in members]) for members in layout]
        for bucket in self._buckets:
            setattr(bucket.flat, _OWNER, weakref.ref(self))
        self._members = layout
        self._slots = [Slot(0, 0)] * len(self._params)
        self._views: list[torch.Tensor] = [torch.empty(0)] * len(self._params)
        # Where each view starts in its bucket's memory (see _check_in_bucket).
        self._offsets = [0] * len(self._params)
        with torch.no_grad():
            for b, members in enumerate(layout):
                for k, i in enumerate(members):
                    self._slots[i] = Slot(b, k)
                    view = self._views[i] = self._buckets[b].views[k]
                    # -1: an empty view has no address of its own (data_ptr() is 0).
                    flat = self._buckets[b].flat
                    self._offsets[i] = view.data_ptr() - flat.data_ptr() if view.numel() else -1
                    param = self._params[i]
                    if param.grad is not None:
                        view.copy_(param.grad)
                        param.grad = view
        hierarchical = hyperparameters.is_hierarchical_reduce and self._hierarchical is not None
        self._strategy: Any = self._hierarchical if hierarchical else self._flat
        if self._exchange is not None:
            self._strategy = self._exchange
        self._hyperparameters = Hyperparameters(hyperparameters.bucket_size_2p, hierarchical)

    def set_exchange(self, exchange: ExchangeFactory) -> None:
        """Average with ``exchange(buckets, None)`` from the next backward on (between
        iterations; ``buckets()`` returns the buckets in launch order). Once: an exchange
        may keep state per bucket, as torch's communication hooks do (torch refuses a second
        one too)."""
        with self._lock:
            self._check_idle("change the gradient exchange")
            if self._exchange is not None:
                raise ReductionError(
                    "register_comm_hook can only be called once (as with torch's DDP), and not "
                    "with an algorithm other than GradientAllReduce"
                )
            made = exchange(_buckets_of(weakref.ref(self)), None)
            if made is None:
                raise ValueError("set_exchange needs an exchange, got None")
            self._exchange = self._strategy = made

    @property
    def _divides(self) -> bool:
        # A communication hook is handed the ranks' sum and averages it itself, as in torch.
        return self._world_size > 1 and not getattr(self._strategy, "expects_sum", False)

    # -- one backward ----------------------------------------------------------------------

    def _reset_backward_state(self) -> None:
        self._active = False
        self._ready = [False] * len(self._params)
        self._pending = [len(members) for members in self._members]
        self._next_bucket = 0
        self._handles: list[Any] = []
        self._absent: dict[int, list[int]] = {}  # bucket -> slots whose .grad was None
        self._divided = [False] * len(self._params)  # already divided by the world size
        self._ready_order: list[int] = []
        self._stream: Any = None

    def _check_idle(self, action: str) -> None:
        if self._active:
            raise ReductionError(
                f"cannot {action}: the previous backward's gradient averaging did not finish "
                "(did backward raise?). Every rank must finish each backward."
            )

    def check_module(self, module: torch.nn.Module) -> None:
        """Raise if ``module`` (the wrapper's ``.module`` at a forward) is not the module the
        reducer was built for, or has trainable parameters registered since (a new head, an
        adapter): they would train without averaging (torch's DDP lets them, silently). A
        parameter registered frozen is watched like one frozen at construction."""
        if self._module is not None and self._module() is not module:
            raise ReductionError(
                "model.module was replaced after wrapping: its parameters would train without "
                "averaging. Wrap the new module instead: "
                "distune.DistributedDataParallel(new_module)"
            )
        if self._added is not None and self._added.changed:
            self._added.changed = False
            self._check_module_unchanged()

    def prepare_for_forward(self, sync: bool) -> None:
        """Arm the reducer for the coming backward if ``sync`` (a forward outside no_sync), as
        torch DDP decides it at forward time; raise if the previous backward was left half done.

        A forward inside no_sync does not disarm: after ``a = model(x)`` and, inside no_sync,
        ``b = model(y)``, ``(a + b).backward()`` is averaged, as with torch DDP.
        """
        with self._lock:
            self._check_idle("start a forward")
            _refuse_compiled_autograd()
            if sync:
                self.armed = True
            self._forwarded = True
            self._spares = []
            self._reached_nodes = []  # whatever backward reached them is over

    def watch(self, output: Any) -> None:
        """Follow the backward through ``output``, what a forward that armed the reducer
        returned (hooks on its tensors, which run as a backward reaches them):

        * once the reducer has averaged a backward since this forward, a backward through
          ``output`` raises before any gradient: its gradients would stay local (torch DDP
          lets them), so the ranks would silently drift apart. That is a second backward
          after one forward (``retain_graph=True``), or two forwards and a backward for each;
        * a ``backward()`` through ``output`` that reaches none of the parameters (this rank's
          forward used none, or its loss kept none of them) still averages, with zeros: the
          other ranks' backward waits for this rank's buckets (torch's DDP leaves them waiting,
          then pairs them with this rank's next backward);
        * a forward whose output no backward reached before the next averaged backward is
          logged once (see :meth:`_report_unreached`).
        """
        tensors = [t for t in tensors_in(output) if t.grad_fn is not None]
        # Not on a leaf (a parameter returned as is): its hooks would outlive the forward.
        if not tensors:
            return
        forward = WatchedForward(self.iterations)
        self._unreached += 1
        reference = weakref.ref(self)
        for tensor in tensors:
            tensor.register_hook(partial(_on_output_grad, reference, forward))

    def _output_reached(self, forward: WatchedForward) -> None:
        if self.iterations > forward.iterations:
            raise ReductionError(
                "a backward reached the output of a forward whose gradients were already "
                "averaged by an earlier backward (two backward calls after one forward, or "
                "two forwards then a backward for each): this backward's gradients would "
                "stay local, so the ranks would drift apart (torch's DDP lets them, "
                "silently). Sum the losses into one backward, or run a forward before each "
                "backward"
            )
        if not forward.reached:
            forward.reached = True
            self._unreached -= 1
        if self.armed and not self._active:
            # Backward reaches the output before any parameter: look again at its end, from
            # the output's nodes (the node running this hook; kept only until then, since a
            # node held by its own tensor's hook would be a reference cycle).
            self._reached_nodes.append(torch._C._current_autograd_node())
            if len(self._reached_nodes) == 1:
                torch.autograd.Variable._execution_engine.queue_callback(
                    self._after_output_backward
                )

    def _after_output_backward(self) -> None:
        """At the end of a backward that reached a watched output: if it reached none of the
        parameters but accumulates into some leaf (``backward()``, not ``autograd.grad``),
        take part in the other ranks' averaging with zeros, as if every parameter were
        unused here."""
        nodes, self._reached_nodes = self._reached_nodes, []
        if self._active or not self.armed or not accumulates_from(nodes):
            return  # averaged by its own callback, or nothing for this wrapper to do
        self._begin_backward(queue=False)
        self._end_backward()

    def _grad_ready(self, index: int) -> None:
        with self._lock:
            if not self.armed:
                self._note_local(index)
                return  # no_sync, or a backward this wrapper's forward did not arm
            if not self._active:
                self._begin_backward()
            if self._ready[index]:
                raise ReductionError(
                    f"parameter {self._names[index]!r} received its gradient twice in one "
                    "backward (a parameter used in several reentrant checkpoints is not "
                    "supported: use torch.utils.checkpoint with use_reentrant=False)"
                )
            grad = self._params[index].grad
            if grad is None:  # the hook runs after accumulation: another hook cleared it
                self._raise_grad_taken(index, "before")
            if grad is not self._views[index] and grad._base is not None:
                self._check_not_shared(index, grad)  # a view: of another wrapper's bucket?
            if grad.is_sparse:
                raise ReductionError(
                    f"parameter {self._names[index]!r} has a sparse gradient; distune averages "
                    "dense gradients only (use a dense embedding)"
                )
            if grad.requires_grad:
                raise ReductionError(
                    f"parameter {self._names[index]!r} has a gradient that carries a graph "
                    "(backward(create_graph=True)), which the buckets cannot hold (torch's DDP "
                    "fails too: 'a leaf Variable that requires grad is being used in an "
                    "in-place operation'): take higher-order terms with "
                    "torch.autograd.grad(..., create_graph=True) and call backward() without "
                    "create_graph"
                )
            self._into_bucket(index)
            self._mark_ready(index)

    def _note_local(self, index: int) -> None:
        """A gradient this wrapper leaves local. With no forward through the wrapper since the
        last averaged backward, it came from a backward through ``model.module`` (or a loss
        of the inner module's own methods): logged once, at the end of that backward, unless
        another wrapper of the parameter averages it (re-wrapping leaves the old one inert)."""
        if not (self._forwarded or self._reported_local or self._local_check is not None):
            self._local_check = index
            torch.autograd.Variable._execution_engine.queue_callback(self._report_local)

    def _report_local(self) -> None:
        index, self._local_check = self._local_check, None
        assert index is not None
        grad = self._params[index].grad
        owner = None if grad is None or grad._base is None else getattr(grad._base, _OWNER, None)
        other = None if owner is None else owner()
        if self._forwarded or self._reported_local or (other is not None and other is not self):
            return
        self._reported_local = True
        logger.warning(
            "a backward reached parameter %r without a forward through its "
            "DistributedDataParallel since the last averaged backward (a backward through "
            "model.module, or a loss computed by the inner module's own methods): its "
            "gradients stay local to this rank, as with torch's DDP, and an optimizer step "
            "on them makes the ranks' models drift apart. If this is a training step, run its "
            "forward through the wrapper: model(x). (Logged once.)",
            self._names[index],
        )

    def _raise_grad_taken(self, index: int, when: str) -> NoReturn:
        """``.grad`` was cleared or replaced during backward by a hook that ran ``when``
        (before or after) the reducer's: that hook saw this rank's gradient, not the average."""
        raise ReductionError(
            f"the .grad of parameter {self._names[index]!r} was cleared or replaced during "
            f"backward by a hook that ran {when} distune's (an optimizer step in a "
            "post-accumulate-grad hook, 'optimizer in backward'?): that code saw this rank's "
            "gradient, not the average over the ranks (torch's DDP lets it, silently), and "
            "the ranks' models drift apart. Step the optimizer after backward() returns"
        )

    def _check_in_bucket(self, index: int) -> None:
        """Raise if the module was converted after wrapping (``model.half()``, ``.to(dtype,
        device or memory_format=...)``): the parameter is no longer of its bucket's dtype and
        device, or its view (``.grad``) no longer lies in its bucket's memory.

        The conversion converts each ``.grad`` in place through ``.data``: still this view
        object, now its own memory, so what autograd accumulates there (or what is copied
        into it) would never be averaged. Compared with the bucket's address, not a stored
        one, so a bucket moved as a whole (``share_memory_()``) stays valid.
        """
        view, slot, param = self._views[index], self._slots[index], self._params[index]
        dtype, device = self._keys[index]
        flat, offset = self._buckets[slot.bucket].flat, self._offsets[index]
        if (
            (offset < 0 or view.data_ptr() == flat.data_ptr() + offset)
            and param.dtype is dtype
            and param.device == device
        ):
            return
        now, was = f"{param.dtype} on {param.device}", f"{dtype} on {device}"
        change = f"is {now} but was {was}" if now != was else "has a new memory layout"
        raise ReductionError(
            f"parameter {self._names[index]!r} {change}: the module was converted after "
            "wrapping (model.half(), .to(dtype, device or memory_format=...)), and its gradient "
            "bucket was built for the parameter as it was, so its gradients would not be "
            "averaged. Convert the module first, then wrap it (torch's DDP documentation "
            "states the same rule: never change the parameters after wrapping)"
        )

    def _check_not_shared(self, index: int, grad: torch.Tensor) -> None:
        """Raise if ``grad`` is a view of the bucket of another reducer averaging this backward:
        two wrappers share the parameter, and the second would average (and divide) what the
        first is still averaging."""
        owner = getattr(grad._base, _OWNER, None)
        other = None if owner is None else owner()
        if other is not None and other is not self and other.armed:
            raise ReductionError(
                f"parameter {self._names[index]!r} is averaged by two DistributedDataParallel "
                "wrappers in one backward (they share it): each would average it, the second "
                "what the first is still averaging. Wrap one module holding both models (e.g. "
                "an nn.ModuleDict of them)"
            )

    def _into_bucket(self, index: int) -> None:
        """Make ``.grad`` the bucket view, holding the gradient (zeros if it is ``None``)."""
        self._check_in_bucket(index)
        param, view = self._params[index], self._views[index]
        grad = param.grad
        slot = self._slots[index]
        if grad is None:
            view.zero_()
            self._absent.setdefault(slot.bucket, []).append(slot.index)
            self._divided[index] = True
            return
        if grad is not view and not _same_storage(grad, view):
            # Autograd made a new tensor (.grad was None: zero_grad(set_to_none=True)). A large
            # one is copied and divided in one pass, as torch DDP does; a small one is only
            # copied (a third of the dispatch cost), and divided with its bucket at launch.
            if self._keep_spares:
                self._spares.append(grad)
            if self._divides and grad.numel() >= FUSED_DIVISION_MIN_NUMEL:
                torch.div(grad, self._world_size, out=view)
                self._divided[index] = True
            else:
                view.copy_(grad)
        if grad is not view:
            param.grad = view

    def _begin_backward(self, queue: bool = True) -> None:
        """Start averaging this backward; ``queue``: end it in a callback at its end."""
        self._active = True
        if self._params[0].device.type == "cuda":
            # As torch DDP does: remember the stream backward runs on, and make that stream (not
            # the host) wait for the buckets in the end-of-backward callback.
            self._stream = torch.cuda.current_stream(self._params[0].device)
        if queue:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _mark_ready(self, index: int) -> None:
        self._ready[index] = True
        self._ready_order.append(index)
        slot = self._slots[index]
        self._pending[slot.bucket] -= 1
        while self._next_bucket < len(self._buckets) and self._pending[self._next_bucket] == 0:
            self._launch(self._next_bucket)
            self._next_bucket += 1

    def _launch(self, b: int) -> None:
        bucket = self._buckets[b]
        bucket.flags.fill_(1)
        for k in self._absent.get(b, ()):
            bucket.flags[k] = 0
        if self._divides:
            # Divide what was not divided on the way in, one op per run of adjacent gradients
            # (the whole bucket at once in the common cases).
            runs: list[list[int]] = []
            for k, index in enumerate(self._members[b]):
                if not self._divided[index]:
                    start, end = bucket.spans[k]
                    if runs and runs[-1][1] == start:
                        runs[-1][1] = end
                    else:
                        runs.append([start, end])
            for start, end in runs:
                bucket.grads[start:end].div_(self._world_size)
        self._handles.append(self._strategy.start(bucket.flat))

    def _end_backward(self) -> None:
        if not all(self._ready):
            enclosing = _enclosing_node()
            if enclosing is not None:
                # A backward nested in another (reentrant checkpointing) ended, and parameters
                # outside it may still get gradients in the enclosing backward: end with that
                # one instead (a hook on the node that ran the nested backward queues this
                # callback there). One reduction, one iteration per backward, as torch DDP.
                enclosing.register_hook(self._queue_end)
                return
        stream = self._stream
        guard = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        with self._lock, guard:
            try:
                self._finish_reduction()
            finally:
                ready_order = self._ready_order
                self._reset_backward_state()
                self.armed = self._forwarded = False
            self.iterations += 1
            if self.after_reduction is not None:
                self.after_reduction()
        self._report_unreached()
        self._after_iteration(ready_order)

    def _report_unreached(self) -> None:
        """Log once if a forward since the last averaged backward had no backward through its
        output: where another rank ran one, the two ranks' averaging no longer pair up."""
        unreached, self._unreached = self._unreached, 0
        if unreached > 0 and not self._reported_unreached:
            self._reported_unreached = True
            logger.warning(
                "%d forward(s) through DistributedDataParallel (with gradients, outside "
                "no_sync) had no backward through their output before this averaged backward. "
                "If another rank ran a backward for such a forward, its gradient averaging now "
                "pairs with this rank's next backward, one iteration off, and the job hangs at "
                "its end (as with torch's DDP). Run forwards that need no backward under "
                "torch.no_grad(); on a rank with nothing to learn from a batch, call backward "
                "on its output times zero (e.g. (model(x).sum() * 0).backward())",
                unreached,
            )

    def _queue_end(self, *_: Any) -> None:
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _after_iteration(self, ready_order: list[int]) -> None:
        if not self._order_known:
            self._learn_order(ready_order)
        if self.on_iteration is not None:
            switch = self.on_iteration(self.iterations)
            if switch is not None:
                self.rebuild(switch)

    def _finish_reduction(self) -> None:
        # Parameters without a gradient in this backward: contribute .grad as it is (zeros if
        # None), in an order every rank shares, so the last buckets launch everywhere.
        if not all(self._ready) or any(p.requires_grad for p in self._frozen):
            self._check_module_unchanged()
        hooked = list(self._ready_order)
        for index in range(len(self._params)):
            if self._ready[index]:
                continue
            self._into_bucket(index)
            self._mark_ready(index)
        self._strategy.finish(self._handles)
        for index in hooked:
            if self._params[index].grad is not self._views[index]:
                self._raise_grad_taken(index, "after")
        for b, slots in self._absent.items():
            bucket = self._buckets[b]
            for k in slots:
                # Reads back one flag (a host sync on CUDA), only for parameters absent here;
                # .real: a complex bucket's flags are complex.
                if bucket.flags[k].real.item() > 0:
                    self._params[self._members[b][k]].grad = bucket.views[k]

    def _check_module_unchanged(self) -> None:
        module = None if self._module is None else self._module()
        if module is None:
            return
        known = {id(p) for p in self._params}
        watched = {id(p) for p in self._frozen}
        added = []
        for name, param in module.named_parameters():
            if id(param) in known or name in self._ignored:
                continue
            if param.requires_grad:
                added.append(name)
            elif id(param) not in watched:
                self._frozen.append(param)  # registered frozen: unfreezing it is caught
        if added:
            raise ReductionError(
                f"the module has trainable parameters it did not have when it was wrapped "
                f"({', '.join(added[:5])}{', ...' if len(added) > 5 else ''}): a parameter or "
                "submodule added or replaced (or a parameter unfrozen, or load_state_dict("
                "..., assign=True), which replaces them) after wrapping would train without "
                "averaging. Wrap the module again: distune.DistributedDataParallel(model.module)"
                " (or load the state dict without assign=True, which copies into them)"
            )

    def _learn_order(self, ready_order: list[int]) -> None:
        """Adopt rank 0's order of gradient readiness (a collective, once)."""
        if not ready_order:
            ready_order = self._order  # a joined rank's shadow backward: the guess
        order = torch.tensor(ready_order, dtype=torch.int64, device=self._device)
        dist.broadcast(
            order, src=dist.get_global_rank(self._process_group, 0), group=self._process_group
        )
        self._order_known = True
        learned = order.tolist()
        if learned != self._order:
            self._order = learned
            self.rebuild(self._hyperparameters)

    # -- uneven inputs ---------------------------------------------------------------------

    def shadow_backward(self) -> None:
        """On a rank that has run out of inputs (see :mod:`.join`): join the collectives of
        one synchronised backward of the other ranks with zeros (no gradient, no used flag),
        leaving this rank's gradients alone; the iteration counts, as on the others."""
        with self._lock:
            self._check_idle("shadow a backward")
            handles = [
                self._strategy.start(torch.zeros_like(bucket.flat)) for bucket in self._buckets
            ]
            self._strategy.finish(handles)
            self.iterations += 1
        self._after_iteration([])


def _refuse_compiled_autograd() -> None:
    """Raise if compiled autograd is on (it would fail inside dynamo at the backward).

    Run eagerly even under ``torch.compile`` of the wrapper: dynamo does not trace the lock
    around it. Looked up, not imported: a job that never compiles never loads torch._dynamo
    (seconds of import)."""
    compiled = sys.modules.get("torch._dynamo.compiled_autograd")
    config = sys.modules.get("torch._dynamo.config")
    if getattr(compiled, "compiled_autograd_enabled", False) or getattr(
        config, "compiled_autograd", False
    ):
        raise ReductionError(
            "compiled autograd is on: it traces backward into a graph, and distune's reducer "
            "averages from Python hooks and an end-of-backward callback it cannot trace "
            "(torch's C++ DDP reducer is refused by it too). Turn compiled autograd off "
            "(torch._dynamo.config.compiled_autograd = False): torch.compile of the model "
            "works with distune's wrapper"
        )


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.dtype == b.dtype
