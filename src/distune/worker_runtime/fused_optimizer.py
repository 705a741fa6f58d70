"""``distune.fuse_optimizer``: any torch optimizer stepping over a few flat tensors.

A torch optimizer's ``step`` loops over parameters (or, with ``foreach``, over lists of them):
on a model of many small parameters the per-tensor overhead, not the arithmetic, sets the step
time. Fusing copies each parameter group's parameters of one (dtype, device) into one flat
tensor and makes the parameters views of it, so the model trains on the same memory; gradients
get a flat buffer of the same layout; the wrapped optimizer sees only the flat tensors, so its
state (momentum, Adam's moments) is flat too. Elementwise optimizers (SGD, Adam, AdamW,
RMSprop, Adagrad, ...) then compute exactly what they compute unfused, in a few large kernels.

Differences from the unfused optimizer, by construction:

* Optimizers whose update is not elementwise per parameter (LBFGS, Adafactor's factored
  moments, anything using a parameter's shape or norm) change their math when fused; do not fuse
  them.
* Within one flat tensor, a parameter whose ``.grad`` is ``None`` while others have one is
  stepped with a zero gradient (unfused, the optimizer would skip it; weight decay and momentum
  still move it here). A flat tensor none of whose parameters has a gradient is skipped, as
  unfused.

:meth:`FusedOptimizer.state_dict` writes the unfused layout (one state entry per original
parameter), so checkpoints move freely between fused and unfused optimizers.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from distune.errors import DistuneError


class FusedOptimizerError(DistuneError, ValueError):
    """An optimizer or state dict cannot be fused as asked; the message says why."""


@dataclass
class _Flat:
    """One parameter group's parameters of one (dtype, device), in one flat tensor."""

    param: nn.Parameter
    grad: torch.Tensor
    members: list[torch.Tensor]
    spans: list[tuple[int, int]]
    grad_views: list[torch.Tensor]

    def gather_grads(self) -> None:
        """Make ``param.grad`` the flat gradient of the members (zeros for a member without one)."""
        grads = [m.grad for m in self.members]
        if all(g is None for g in grads):
            self.param.grad = None
            return
        self.param.grad = self.grad
        stale = [k for k, g in enumerate(grads) if g is not self.grad_views[k]]
        if not stale:
            return  # backward accumulated into the flat buffer in place
        if len(stale) == len(grads) and all(g is not None for g in grads):
            torch.cat([g.reshape(-1) for g in grads], out=self.grad)  # type: ignore[union-attr]
        else:
            for k in stale:
                grad, view = grads[k], self.grad_views[k]
                if grad is None:
                    view.zero_()
                else:
                    view.copy_(grad)
        for k in stale:
            # From now on autograd accumulates straight into the flat buffer.
            self.members[k].grad = self.grad_views[k]

    def zero_grad(self, set_to_none: bool) -> None:
        if set_to_none:
            for member in self.members:
                member.grad = None
            self.param.grad = None
            return
        self.grad.zero_()
        for member, view in zip(self.members, self.grad_views, strict=True):
            if member.grad is not None and member.grad is not view:
                member.grad = view


def _fuse_params(params: list[torch.Tensor]) -> list[_Flat]:
    """Move ``params`` into flat tensors, one per (dtype, device), in first-seen order."""
    by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for param in params:
        if param.layout != torch.strided:
            raise FusedOptimizerError(
                f"fuse_optimizer fuses dense parameters only; found one with layout {param.layout}"
            )
        by_kind.setdefault((param.dtype, param.device), []).append(param)
    flats = []
    for (dtype, device), members in by_kind.items():
        total = sum(m.numel() for m in members)
        data = torch.empty(total, dtype=dtype, device=device)
        grad = torch.zeros(total, dtype=dtype, device=device)
        spans, grad_views = [], []
        offset = 0
        with torch.no_grad():
            for member in members:
                end = offset + member.numel()
                data[offset:end].copy_(member.reshape(-1))
                spans.append((offset, end))
                grad_views.append(grad[offset:end].view_as(member))
                offset = end
            for member, (start, end) in zip(members, spans, strict=True):
                # The model now trains on the flat tensor's memory.
                member.data = data[start:end].view_as(member)
        flat = _Flat(nn.Parameter(data), grad, members, spans, grad_views)
        for k, member in enumerate(members):
            if member.grad is not None:
                flat.grad_views[k].copy_(member.grad)
                member.grad = flat.grad_views[k]
        flats.append(flat)
    return flats


class FusedOptimizer(torch.optim.Optimizer):
    """A torch optimizer whose parameters, gradients and state live in flat tensors.

    Made by :func:`fuse_optimizer`. ``param_groups`` are the wrapped optimizer's (each holding
    its flat tensors), so learning-rate schedulers and code that sets ``lr`` work unchanged.
    ``step``, ``zero_grad``, ``state_dict`` and ``load_state_dict`` behave as the wrapped
    optimizer's; state dicts use the unfused layout.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        # Not Optimizer.__init__: the groups and state are the wrapped optimizer's own objects.
        self.optimizer = optimizer
        self.defaults = optimizer.defaults
        self._optimizer_step_pre_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_state_dict_pre_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_state_dict_post_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: OrderedDict[int, Callable[..., Any]] = (
            OrderedDict()
        )
        self._optimizer_load_state_dict_post_hooks: OrderedDict[int, Callable[..., Any]] = (
            OrderedDict()
        )
        #: Per parameter group: its original parameters, and its flat tensors.
        self._originals: list[list[torch.Tensor]] = []
        self._flats: list[list[_Flat]] = []
        unfused_state = optimizer.state_dict() if optimizer.state else None
        for group in optimizer.param_groups:
            self._fuse_group(group)
        if unfused_state is not None:
            self.load_state_dict(unfused_state)

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        """The wrapped optimizer's parameter groups (their ``params`` are the flat tensors)."""
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        """The wrapped optimizer's state, keyed by flat tensor."""
        return self.optimizer.state

    def _fuse_group(self, group: dict[str, Any]) -> None:
        originals = list(group["params"])
        flats = _fuse_params(originals)
        group["params"] = [flat.param for flat in flats]
        self._originals.append(originals)
        self._flats.append(flats)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the wrapped optimizer and fuse its parameters."""
        self.optimizer.add_param_group(param_group)
        self._fuse_group(self.optimizer.param_groups[-1])

    def _gather_grads(self) -> None:
        for flats in self._flats:
            for flat in flats:
                flat.gather_grads()

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Gather the gradients into the flat buffers and step the wrapped optimizer."""
        for hook in list(self._optimizer_step_pre_hooks.values()):
            hook(self, (), {})
        if closure is None:
            self._gather_grads()
            loss = self.optimizer.step()
        else:

            def fused_closure() -> Any:
                with torch.enable_grad():
                    value = closure()
                self._gather_grads()
                return value

            loss = self.optimizer.step(fused_closure)
        for hook in list(self._optimizer_step_post_hooks.values()):
            hook(self, (), {})
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch's: drop (or zero, in one op per flat tensor) the gradients."""
        for flats in self._flats:
            for flat in flats:
                flat.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict in the unfused layout: one entry per parameter,
        numbered as an unfused optimizer over the same groups numbers them."""
        fused = self.optimizer.state_dict()
        flat_index = 0
        index = 0
        state: dict[int, dict[str, Any]] = {}
        groups = []
        for fused_group, flats in zip(fused["param_groups"], self._flats, strict=True):
            indices = []
            for flat in flats:
                entry = fused["state"].get(flat_index)
                flat_index += 1
                for k, (start, end) in enumerate(flat.spans):
                    if entry is not None:
                        state[index] = {
                            key: _split(value, flat.param, start, end, flat.members[k])
                            for key, value in entry.items()
                        }
                    indices.append(index)
                    index += 1
            groups.append({**fused_group, "params": indices})
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict in the unfused layout (from :meth:`state_dict` or from an unfused
        optimizer over the same parameter groups)."""
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self._flats):
            raise FusedOptimizerError(
                f"the state dict has {len(saved_groups)} parameter group(s), this optimizer "
                f"{len(self._flats)}"
            )
        saved_state = state_dict["state"]
        state: dict[int, dict[str, Any]] = {}
        groups = []
        flat_index = 0
        for saved_group, originals, flats in zip(
            saved_groups, self._originals, self._flats, strict=True
        ):
            ids = list(saved_group["params"])
            if len(ids) != len(originals):
                raise FusedOptimizerError(
                    f"a saved parameter group has {len(ids)} parameter(s), this optimizer's "
                    f"{len(originals)}"
                )
            by_param = dict(zip(map(id, originals), ids, strict=True))
            flat_ids = []
            for flat in flats:
                entries = [saved_state.get(by_param[id(m)]) for m in flat.members]
                if any(e is not None for e in entries):
                    state[flat_index] = _join(entries, flat)
                flat_ids.append(flat_index)
                flat_index += 1
            groups.append({**saved_group, "params": flat_ids})
        self.optimizer.load_state_dict({"state": state, "param_groups": groups})


def _split(value: Any, flat: torch.Tensor, start: int, end: int, member: torch.Tensor) -> Any:
    if isinstance(value, torch.Tensor) and value.shape == flat.shape:
        return value[start:end].view_as(member).clone()
    # Copies: optimizers step scalar state such as ``step`` in place.
    return value.clone() if isinstance(value, torch.Tensor) else value


def _join(entries: list[dict[str, Any] | None], flat: _Flat) -> dict[str, Any]:
    present = [e for e in entries if e is not None]
    if len(present) != len(entries):
        raise FusedOptimizerError(
            "the state dict has optimizer state for some parameters of a fused group and not "
            "for others: it cannot be fused (load it into the unfused optimizer, step once, "
            "then fuse)"
        )
    joined: dict[str, Any] = {}
    for key, first in present[0].items():
        values = [e[key] for e in present]
        per_element = all(
            isinstance(v, torch.Tensor) and v.shape == m.shape
            for v, m in zip(values, flat.members, strict=True)
        ) and not (key == "step" and all(m.dim() == 0 for m in flat.members))
        if per_element:
            joined[key] = torch.cat([v.reshape(-1) for v in values])
            continue
        if not all(_same(first, v) for v in values[1:]):
            raise FusedOptimizerError(
                f"optimizer state {key!r} differs between parameters of one fused group "
                "(fusing needs one value per group, e.g. the same step count)"
            )
        # A copy: torch's load_state_dict keeps ``step`` tensors as given, and they are stepped
        # in place.
        joined[key] = first.clone() if isinstance(first, torch.Tensor) else first
    return joined


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and bool(torch.equal(a.cpu(), b.cpu()))
    return bool(a == b)


def fuse_optimizer(optimizer: torch.optim.Optimizer) -> FusedOptimizer:
    """Fuse ``optimizer``'s parameters, gradients and state into flat tensors.

    Call it after building the optimizer (and after wrapping the model in
    ``DistributedDataParallel``), then use the returned optimizer instead of ``optimizer``; the
    model's parameters become views of the flat tensors. Results equal the unfused optimizer's
    for elementwise optimizers (SGD, Adam, AdamW, ...): see the module documentation for the
    exceptions. Existing state (a resumed optimizer) is fused too.
    """
    if isinstance(optimizer, FusedOptimizer):
        raise FusedOptimizerError("the optimizer is already fused")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
    return FusedOptimizer(optimizer)
