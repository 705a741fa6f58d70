"""The name a wrapped model is tuned under, and the check that two live models do not share it.

The service keeps one tuning session per name. Two sessions must never be fed by one name:

* Two wrappers of one process with the same name would register twice with different facts;
  the service refuses the second (409). The name is checked here first, at construction, with
  a message that says what to do. The default name is the exception: a script written for
  torch's DDP that wraps two models (a GAN's generator and discriminator) names neither, so
  the default ``model0`` moves on to the first free ``model1``, ``model2``, ... Every rank
  constructs its wrappers in the same order (construction is collective), so every rank
  numbers them alike.
* With data-parallel subgroups (``process_group=`` a subgroup), each subgroup's rank 0 is a
  leader: each subgroup is its own job as far as tuning goes, so its session is named
  ``<name>.r<first global rank of the subgroup>`` (the whole job keeps ``<name>``).

A new wrapper of the module an older live wrapper of the same name wraps (re-wrapping
``model.module`` after unfreezing part of it) replaces it: the old one's tuning stops, as the
old wrapper of torch DDP goes inert, and the name passes to the new one. Its leader registers
the name again with its own facts (more gradient bytes), which the service tunes afresh, once
the old leader's thread has ended (``_Holder.replaced``; docs/worker_runtime.md, "Names"). So
does a wrapper whose name was last held by a wrapper since dropped (``del model``, then the
module wrapped again): the dropped wrapper's thread may still be posting its last report.

A wrapper of *another* module that shares parameters with a live wrapper (tied weights: an
encoder and a decoder sharing an embedding) is another model, not a re-wrap: it takes no name
over (the older one would silently stop tuning), it is numbered on or refused like any other
second model, and :meth:`NameRegistry.sharing` lets its constructor warn, naming both.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from distune.errors import DistuneError
from distune.space import MODEL_NAME_RULE, is_valid_model_name
from distune.worker_runtime.leader_client import LeaderClient

#: The name of a model that is given none; numbered on when it is taken (see the module doc).
DEFAULT_NAME = "model0"


class ModelNameError(DistuneError, ValueError):
    """Two live models of one process were given the same name."""


def tuning_name(name: str, process_group: dist.ProcessGroup) -> str:
    """The session name of model ``name`` averaged over ``process_group``."""
    if dist.get_world_size(process_group) == dist.get_world_size():
        return name
    scoped = f"{name}.r{dist.get_global_rank(process_group, 0)}"
    if not is_valid_model_name(scoped):
        raise ValueError(
            f"a model averaged over a subgroup is tuned as {scoped!r}, which must be "
            f"{MODEL_NAME_RULE}: choose a shorter name"
        )
    return scoped


class _Holder:
    """A live wrapper's claim on a name: its parameters, how to stop its tuning, its leader
    client (rank 0's), and the leader client that held the name before (its wrapper live or
    dropped)."""

    def __init__(
        self,
        module: torch.nn.Module,
        params: Sequence[torch.Tensor],
        stop: Callable[[], None],
        client: LeaderClient | None,
        replaced: LeaderClient | None,
    ) -> None:
        # Weak: the claim must not keep a dropped wrapper's module alive.
        self.module = weakref.ref(module)
        self.param_ids = {id(p) for p in params}
        self.stop = stop
        self.client = client
        #: Start this wrapper's client after it (``LeaderClient.start``).
        self.replaced = replaced


class NameRegistry:
    """The tuning names claimed by live wrappers of this process.

    Claims are weak: a wrapper that is dropped releases its name without being told.
    """

    def __init__(self) -> None:
        self._holders: weakref.WeakValueDictionary[str, _Holder] = weakref.WeakValueDictionary()
        # Each name's last leader client, kept past its wrapper: a dropped wrapper's thread may
        # still post its last report, which must reach the service before the next
        # registration of the name (the service would take it for a second live model).
        self._last_clients: dict[str, LeaderClient] = {}

    def name_for(self, name: str, module: torch.nn.Module, process_group: dist.ProcessGroup) -> str:
        """The name a new wrapper of ``module`` over ``process_group`` asked for ``name`` is
        tuned under: ``name``, or for the default name the first ``model<k>`` free; one held
        by an older wrapper of the same module is free (:meth:`claim` takes it over).
        Raises :class:`ModelNameError` if another model holds a name that was given."""
        numbered = name == DEFAULT_NAME
        for number in itertools.count():
            candidate = f"model{number}" if numbered else name
            previous = self._holders.get(tuning_name(candidate, process_group))
            if previous is None or previous.module() is module:
                return candidate
            if not numbered:
                break
        raise ModelNameError(
            f"two models are named {name!r} in this process: the tuning service keeps one "
            "session per name, so give each DistributedDataParallel its own name= (e.g. "
            "name='generator' and name='discriminator'); a module wrapped again takes its "
            "name over only if it is the same module (wrap model.module again)"
        )

    def sharing(self, module: torch.nn.Module, params: Sequence[torch.Tensor]) -> list[str]:
        """The names of the live wrappers of other modules than ``module`` that hold some of
        ``params`` (tied weights across two wrappers), in name order."""
        ids = {id(p) for p in params}
        return sorted(
            name
            for name, holder in list(self._holders.items())
            if holder.module() is not module and not holder.param_ids.isdisjoint(ids)
        )

    def claim(
        self,
        session: str,
        module: torch.nn.Module,
        params: Sequence[torch.Tensor],
        stop: Callable[[], None],
        client: LeaderClient | None = None,
    ) -> _Holder:
        """Claim ``session`` (a :func:`tuning_name` from :meth:`name_for`) for a wrapper of
        ``module`` averaging ``params`` whose leader client (rank 0) is ``client``; the caller
        keeps the returned claim alive as long as the wrapper. The wrapper holding it before
        (one of the same module) stops tuning; the last client that claimed ``session``,
        whether its wrapper lives or not, is the claim's ``replaced``: ``stop`` is what ends
        this wrapper's tuning when a newer wrapper takes the name over in turn."""
        previous = self._holders.get(session)
        if previous is not None:
            previous.stop()
        holder = _Holder(module, params, stop, client, self._last_clients.get(session))
        if client is not None:
            self._last_clients[session] = client
        self._holders[session] = holder
        return holder


#: The process's registry: names are unique per job, so per process (its one global state).
NAMES_IN_USE = NameRegistry()
