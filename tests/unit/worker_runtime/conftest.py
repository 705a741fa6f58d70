"""Fixtures of the worker runtime's unit tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist


@pytest.fixture
def one_rank() -> Iterator[None]:
    """A gloo world of one rank, in this process, for the duration of the test."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
