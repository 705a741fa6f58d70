"""What an algorithm is to the worker runtime: which knobs it uses and what it runs.

An :class:`Algorithm` is configuration (a frozen dataclass the user builds). Given to
``DistributedDataParallel(..., algorithm=...)``, it yields one of two kinds of runtime part:

* a :class:`GradientExchange` (gradient algorithms): what the engine does with each full bucket
  of gradients, in place of its own flat or hierarchical allreduce. The engine still builds the
  buckets, launches them in order during backward and waits for them at its end;
* a :class:`ModelAverager` (model-averaging algorithms): gradients stay local and the averager
  mixes the model's weights with other ranks' between iterations.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from distune.errors import DistuneError
from distune.worker_runtime.buckets import Bucket
from distune.worker_runtime.topology import HierarchicalProcessGroups


class AlgorithmError(DistuneError, ValueError):
    """An algorithm was configured with a value it does not allow; the message names the
    argument and what is allowed."""


class ModelAveragingError(DistuneError, RuntimeError):
    """Model averaging cannot go on: used after ``finish()``, or its background exchange
    failed (the cause is chained)."""


class GradientExchange(Protocol):
    """Turns each rank's bucket of gradients into the average over the ranks, in place.

    ``start(flat)`` is called once per bucket with the bucket's flat buffer (``Bucket.flat``:
    gradients, then one used flag per parameter, then padding; or a tensor of zeros of that
    layout on a rank that has joined, see ``join``), in launch order, the same on every rank,
    while backward goes on: the ``k``-th call after a ``finish`` is bucket ``k`` of
    ``buckets()``. ``finish`` is called at the end of backward with what the ``start`` calls
    returned, in order, and returns once every flat buffer holds the average of the gradients
    and the per-parameter sum of the flags (the count of ranks that had a gradient).
    """

    #: True when ``start`` receives the ranks' gradients undivided (it averages them itself, as
    #: torch's communication hooks do); False when the engine divides by the world size first.
    expects_sum: bool

    def start(self, flat: torch.Tensor) -> Any:
        """Begin averaging the next bucket, held in ``flat``; return what ``finish`` needs."""
        ...

    def finish(self, handles: list[Any]) -> None:
        """Wait until every started bucket is averaged."""
        ...


#: The engine's buckets in launch order, as they are now (rebuilt when the layout changes).
Buckets = Callable[[], Sequence[Bucket]]


class BucketOrder:
    """Which bucket the next ``start`` is: the ``k``-th since the last ``finish``."""

    def __init__(self, buckets: Buckets) -> None:
        self._buckets = buckets
        self._next = 0

    def next(self) -> tuple[int, int, Bucket]:
        """(index, number of buckets, bucket) of the next ``start``."""
        buckets = self._buckets()
        index = self._next
        self._next += 1
        return index, len(buckets), buckets[index]

    def reset(self) -> None:
        """A ``finish``: the next ``start`` is bucket 0."""
        self._next = 0


class ModelAverager(ABC):
    """Mixes the model's weights with other ranks' between iterations (gradients stay local)."""

    @abstractmethod
    def before_forward(self) -> None:
        """Called by the wrapper before each forward with gradients enabled, on every rank."""

    @abstractmethod
    def finish(self) -> None:
        """End of training on this rank: complete the averaging still under way (a collective
        of this model: every rank calls it once, when it stops training)."""


class Algorithm:
    """A way of keeping the ranks' models in step. Subclasses are frozen dataclasses.

    ``uses_bucket_size`` and ``uses_hierarchical`` say which of the tuner's knobs change what
    the algorithm does; the others are pinned (tuning them would measure noise). The tuner
    never changes the algorithm itself: that would change the training math.
    """

    uses_bucket_size: bool = True
    uses_hierarchical: bool = False

    def gradient_exchange(
        self,
        process_group: dist.ProcessGroup,
        buckets: Buckets,
        hierarchy: HierarchicalProcessGroups | None = None,
    ) -> GradientExchange | None:
        """The exchange of gradient buckets (``buckets()``: the engine's, in launch order;
        ``hierarchy``: the node and leader process groups, where the topology has several
        nodes of several ranks); ``None``: the engine's own allreduce (flat or hierarchical,
        as tuned). Not called for model-averaging algorithms."""
        return None

    def model_averager(
        self, params: Sequence[torch.Tensor], process_group: dist.ProcessGroup
    ) -> ModelAverager | None:
        """The model averager; ``None`` for gradient algorithms. Called on every rank at the
        wrapper's construction (it may create process groups, a collective)."""
        return None

    @property
    def averages_gradients(self) -> bool:
        """Whether gradients are averaged during backward (False: models are averaged)."""
        return True
