"""Parameters and submodules registered on a wrapped module after wrapping.

The reducer averages the parameters the module had when it was wrapped. One added later (a new
head, an adapter set as an attribute) would train on each rank alone, and torch's DDP lets it,
silently: the ranks drift apart. Scanning the module's parameters at every forward would cost
milliseconds per thousand parameters, so this watch uses torch's own registration hooks
(``register_module_parameter_registration_hook`` and its module twin, which fire on every
``register_parameter`` and submodule assignment in the process) and only flags the module: the
reducer scans once, at the next forward, and raises if a new parameter is trainable.
"""

from __future__ import annotations

import weakref
from functools import partial

from torch import nn
from torch.nn.modules.module import (
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)
from torch.utils.hooks import RemovableHandle


def _on_parameter(
    watch_ref: weakref.ref[AddedParameterWatch], module: nn.Module, name: str, param: object
) -> None:
    watch = watch_ref()
    # The same parameter assigned again (weights tied anew in a forward) changes nothing.
    if watch is not None and module in watch.modules and watch.is_new(param):
        watch.changed = True


def _on_module(
    watch_ref: weakref.ref[AddedParameterWatch], parent: nn.Module, name: str, child: object
) -> None:
    watch = watch_ref()
    if watch is not None and parent in watch.modules and isinstance(child, nn.Module):
        watch.modules.update(child.modules())  # parameters added to it later count too
        if any(watch.is_new(param) for param in child.parameters()):
            watch.changed = True


def _remove(handles: list[RemovableHandle]) -> None:
    for handle in handles:
        handle.remove()


class AddedParameterWatch:
    """Sets :attr:`changed` when a parameter other than ``module``'s own at construction is
    registered on ``module`` or any of its submodules (directly, or in a submodule assigned
    to one). Holds the module's submodules weakly; torch's hooks hold the watch weakly and are
    removed when it is freed."""

    def __init__(self, module: nn.Module) -> None:
        #: The wrapped module and its submodules (weakly).
        self.modules: weakref.WeakSet[nn.Module] = weakref.WeakSet(module.modules())
        # Held (not only their ids): a freed parameter's id could be reused by a new one.
        self._known = {id(p): p for p in module.parameters()}
        #: Whether something was registered since the flag was last cleared.
        self.changed = False
        reference = weakref.ref(self)
        handles = [
            register_module_parameter_registration_hook(partial(_on_parameter, reference)),
            register_module_module_registration_hook(partial(_on_module, reference)),
        ]
        weakref.finalize(self, _remove, handles)

    def is_new(self, param: object) -> bool:
        """Whether ``param`` is a parameter the module did not hold at construction."""
        return param is not None and id(param) not in self._known
