"""A ``DistributedSampler`` whose ranks get batches of about equal cost, step by step.

With samples of varying cost (sequence lengths in speech or NLP), ``DistributedSampler`` gives
each rank a random draw: at every step some rank gets the longest batch and all the others wait
for it at the gradient allreduce. This sampler evens the ranks out:

1. each epoch, the indices are shuffled (a generator seeded with ``seed + epoch``) and cut or
   padded to a multiple of the number of ranks, exactly as ``DistributedSampler`` does;
2. they are sorted by cost (plus, with ``random_level``, a little per-epoch noise, so groups
   differ between epochs) and cut into groups of ``num_replicas`` neighbours, samples of nearly
   equal cost;
3. the groups are put in random order, and each group gives one sample to every rank: the most
   costly to the rank whose running total is lowest so far, so the ranks' totals stay level at
   every position, and any batch of consecutive positions costs about the same on every rank.

Every rank computes the same assignment from the same seed and epoch, so no communication is
needed. The order of samples within an epoch is random (groups are shuffled), but neighbouring
positions on one rank are unrelated samples of unrelated cost, not sorted ones.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterator, Sized
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from distune.errors import DistuneError


class SamplerError(DistuneError, ValueError):
    """A sampler argument or a sample's cost is not allowed; the message names it."""


class LoadBalancingDistributedSampler(Sampler[int]):
    """Drop-in for ``torch.utils.data.DistributedSampler`` that balances cost across ranks.

    Args:
        dataset: the dataset (its ``len`` and items).
        complexity_fn: ``complexity_fn(dataset[i])`` is sample ``i``'s cost, a finite number
            (e.g. its sequence length). Called once per sample, at construction.
        num_replicas, rank: as ``DistributedSampler`` (default: the default process group's).
        shuffle: shuffle each epoch (``set_epoch``); without it, the groups keep cost order.
        seed: the shuffle seed, the same on every rank.
        drop_last: as ``DistributedSampler``: drop the tail of the shuffled indices to make
            them divide evenly among the ranks. Otherwise the first indices of the shuffled
            order are added again to fill the last group, so with a dataset whose length is not
            a multiple of ``num_replicas`` a few samples are seen twice in an epoch; every
            sample is still seen at least once, and exactly once when the length divides.
        random_level: noise added to each cost before sorting, as a fraction of the costs'
            range (0: groups are exact cost neighbours; 0.1: neighbours within about a tenth of
            the range, varying by epoch).
    """

    def __init__(
        self,
        dataset: Sized,
        complexity_fn: Callable[[Any], float],
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        random_level: float = 0.0,
    ) -> None:
        if num_replicas is None:
            num_replicas = _world_size()
        if rank is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        if num_replicas < 1:
            raise SamplerError(f"num_replicas must be at least 1, got {num_replicas}")
        if not 0 <= rank < num_replicas:
            raise SamplerError(f"rank must be in [0, {num_replicas - 1}], got {rank}")
        if not 0 <= random_level <= 1:
            raise SamplerError(f"random_level must be in [0, 1], got {random_level}")
        self.dataset = dataset
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.random_level = random_level
        self.epoch = 0
        costs: list[float] = []
        for i in range(len(dataset)):
            cost = complexity_fn(dataset[i])  # type: ignore[index]
            if isinstance(cost, torch.Tensor):
                cost = cost.item()
            # numbers.Real: NumPy's scalars too (an array's .sum() is np.int64, not an int).
            if not isinstance(cost, numbers.Real) or not math.isfinite(cost):
                raise SamplerError(
                    f"complexity_fn must return a finite number; for sample {i} it returned "
                    f"{cost!r}"
                )
            costs.append(float(cost))
        self.costs = torch.tensor(costs, dtype=torch.float64)
        n = len(costs)
        if drop_last and n % num_replicas:
            self.num_samples = n // num_replicas
        else:
            self.num_samples = math.ceil(n / num_replicas)
        self.total_size = self.num_samples * num_replicas

    def __len__(self) -> int:
        """Indices per rank per epoch."""
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch``'s shuffle: call it on every rank before each epoch's iterator."""
        self.epoch = epoch

    def assignment(self) -> torch.Tensor:
        """This epoch's indices of every rank: ``[num_replicas, num_samples]``, the same on all
        ranks."""
        n = len(self.costs)
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(n, generator=generator) if self.shuffle else torch.arange(n)
        if self.total_size <= n:
            order = order[: self.total_size]
        else:
            repeats = math.ceil((self.total_size - n) / n)
            order = torch.cat([order, *([order] * repeats)])[: self.total_size]
        costs = self.costs[order]
        keys = costs
        if self.random_level > 0 and self.shuffle and n:
            spread = float(self.costs.max() - self.costs.min())
            noise = torch.rand(len(order), generator=generator, dtype=torch.float64)
            keys = costs + noise * spread * self.random_level
        # Stable sort: equal costs keep their shuffled order, so ties vary by epoch.
        ranked = torch.sort(keys, stable=True).indices
        groups = ranked.view(self.num_samples, self.num_replicas)
        if self.shuffle:
            groups = groups[torch.randperm(self.num_samples, generator=generator)]
        result = torch.empty(self.num_replicas, self.num_samples, dtype=torch.int64)
        totals = torch.zeros(self.num_replicas, dtype=torch.float64)
        for position, group in enumerate(groups):
            # Most costly sample to the rank that is furthest behind (ties: lowest rank).
            by_cost = group[torch.argsort(costs[group], descending=True, stable=True)]
            receivers = torch.argsort(totals, stable=True)
            result[receivers, position] = order[by_cost]
            totals[receivers] += costs[by_cost]
        return result

    def __iter__(self) -> Iterator[int]:
        return iter(self.assignment()[self.rank].tolist())


def _world_size() -> int:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "LoadBalancingDistributedSampler needs num_replicas and rank, or an initialized "
            "torch.distributed process group to read them from"
        )
    return dist.get_world_size()
