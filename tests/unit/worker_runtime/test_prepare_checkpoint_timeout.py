"""``distune.prepare``'s ``checkpoint_timeout`` (how long a rank waits for the others at a
state-dict collective under a sharded stage): bad values are refused at the call, naming what
is allowed. In a gloo world of one rank, in this process."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

import distune
from distune.trial_settings import DEVICE_MEMORY, TRIAL_DIR, ZERO_STAGE


@pytest.fixture
def one_rank(monkeypatch) -> Iterator[None]:
    for name in (ZERO_STAGE, TRIAL_DIR, DEVICE_MEMORY):
        monkeypatch.delenv(name, raising=False)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("timeout", [0, -1.0, True, "60", None])
def test_a_checkpoint_timeout_that_is_not_a_positive_number_is_refused(one_rank, timeout):
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="checkpoint_timeout must be a number of seconds above 0"):
        distune.prepare(model, optimizer, micro_batch_size=2, checkpoint_timeout=timeout)


def test_a_zero3_checkpoint_on_one_rank_passes_the_rank_check(one_rank, monkeypatch):
    monkeypatch.setenv(ZERO_STAGE, "3")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    run = distune.prepare(model, optimizer, micro_batch_size=2, checkpoint_timeout=0.5)
    run.model(torch.randn(2, 4)).sum().backward()
    run.optimizer.step()
    state = run.optimizer.state_dict()
    assert sorted(state["state"]) == list(range(6))  # torch's format: numbered parameters
    assert set(run.model.state_dict()) == {f"{i}.{p}" for i in range(3) for p in ("weight", "bias")}
