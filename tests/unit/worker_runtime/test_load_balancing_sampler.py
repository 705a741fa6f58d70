"""distune.data.LoadBalancingDistributedSampler: coverage, determinism and cost spread."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils.data import DistributedSampler

import distune


class _Lengths(torch.utils.data.Dataset[int]):
    """Samples that are their own cost (a sequence length)."""

    def __init__(self, lengths: list[int]) -> None:
        self.lengths = lengths

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> int:
        return self.lengths[index]


def _lengths(n: int, seed: int = 0) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    # Long-tailed, as sentence or utterance lengths are.
    return (torch.empty(n).log_normal_(4.0, 0.8, generator=gen).ceil()).int().tolist()


def _samplers(dataset: _Lengths, world: int, **kwargs: object):
    return [
        distune.data.LoadBalancingDistributedSampler(
            dataset, lambda length: length, num_replicas=world, rank=r, **kwargs
        )
        for r in range(world)
    ]


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_every_sample_exactly_once_per_epoch(world: int) -> None:
    dataset = _Lengths(_lengths(24 * 7))
    samplers = _samplers(dataset, world)
    for epoch in range(3):
        for sampler in samplers:
            sampler.set_epoch(epoch)
        seen = [i for sampler in samplers for i in sampler]
        assert sorted(seen) == list(range(len(dataset)))
        assert all(len(list(s)) == len(s) == len(dataset) // world for s in samplers)


def test_padding_and_drop_last_as_distributed_sampler() -> None:
    dataset = _Lengths(_lengths(103))
    padded = _samplers(dataset, 4)
    counts = Counter(i for s in padded for i in s)
    assert set(counts) == set(range(103))  # everything at least once
    assert sum(counts.values()) == 104 and max(counts.values()) == 2  # one repeated, as torch
    assert [len(s) for s in padded] == [
        len(s) for s in (DistributedSampler(dataset, num_replicas=4, rank=r) for r in range(4))
    ]
    dropped = _samplers(dataset, 4, drop_last=True)
    seen = [i for s in dropped for i in s]
    assert len(seen) == len(set(seen)) == 100
    tiny = _samplers(_Lengths([5, 6]), 4)  # fewer samples than ranks: repeated, as torch
    assert [len(list(s)) for s in tiny] == [1, 1, 1, 1]


def test_deterministic_per_epoch_and_different_between_epochs() -> None:
    dataset = _Lengths(_lengths(64))
    a, b = _samplers(dataset, 2, random_level=0.1), _samplers(dataset, 2, random_level=0.1)
    orders = []
    for epoch in range(2):
        a[0].set_epoch(epoch)
        b[0].set_epoch(epoch)
        assert list(a[0]) == list(b[0])
        orders.append(list(a[0]))
    assert orders[0] != orders[1]
    assert list(a[0]) == list(a[0])  # iterating again repeats the epoch
    other_seed = _samplers(dataset, 2, seed=1)[0]
    assert list(other_seed) != list(_samplers(dataset, 2)[0])


def _per_step_spread(samplers, lengths: list[int], batch: int) -> float:
    """Mean over steps of (slowest rank's batch cost / mean rank's batch cost - 1)."""
    per_rank = [list(s) for s in samplers]
    spreads = []
    for start in range(0, len(per_rank[0]) - batch + 1, batch):
        costs = [sum(lengths[i] for i in ranks[start : start + batch]) for ranks in per_rank]
        spreads.append(max(costs) / (sum(costs) / len(costs)) - 1)
    return sum(spreads) / len(spreads)


def test_per_rank_cost_spread_is_far_below_distributed_samplers() -> None:
    lengths = _lengths(4096, seed=3)
    dataset = _Lengths(lengths)
    world, batch = 4, 16
    balanced = _per_step_spread(_samplers(dataset, world), lengths, batch)
    plain = _per_step_spread(
        [DistributedSampler(dataset, num_replicas=world, rank=r) for r in range(world)],
        lengths,
        batch,
    )
    # Measured (seeds 0-4): the slowest rank's batch costs 0.15-0.3% over the mean, against 23-26%
    # with DistributedSampler; the bound leaves room for other seeds.
    assert balanced < 0.03
    assert plain > 5 * balanced


def test_bad_input_is_named() -> None:
    dataset = _Lengths([1, 2, 3])
    with pytest.raises(ValueError, match="rank must be in"):
        distune.data.LoadBalancingDistributedSampler(dataset, len, num_replicas=2, rank=2)
    with pytest.raises(ValueError, match="finite number; for sample 0"):
        distune.data.LoadBalancingDistributedSampler(
            dataset, lambda x: float("nan"), num_replicas=2, rank=0
        )
    with pytest.raises(RuntimeError, match="initialized"):
        distune.data.LoadBalancingDistributedSampler(dataset, lambda x: x)


def test_numpy_scalar_costs_are_numbers() -> None:
    """An array's ``.sum()`` is ``np.int64``, a float32 array's items ``np.float32``: both were
    refused as "complexity_fn must return a finite number ... returned np.int64(5)"."""
    import numpy as np

    dataset = _Lengths(_lengths(40))
    plain = _samplers(dataset, 2)
    for cost in (lambda length: np.int64(length), lambda length: np.float32(length)):
        sampler = distune.data.LoadBalancingDistributedSampler(
            dataset, cost, num_replicas=2, rank=1
        )
        assert list(sampler) == list(plain[1])
    with pytest.raises(ValueError, match=r"finite number; for sample 0 it returned np\.float64"):
        distune.data.LoadBalancingDistributedSampler(
            dataset, lambda length: np.float64("inf"), num_replicas=2, rank=0
        )
