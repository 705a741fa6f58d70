"""zero1's construction: ``ZeroRedundancyOptimizer`` sends each rank's updated shard as one
tensor (``parameters_as_bucket_view``), not one broadcast a parameter. On the 1 gbit/s testbed
the parameter-by-parameter broadcast cost about twice its line-rate time (BENCHMARKS.md,
"zero1's broadcast on the testbed"). In a gloo world of one rank, in this process."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from distune.worker_runtime.strategy import apply


def test_zero1_broadcasts_each_ranks_shard_as_one_tensor(one_rank, monkeypatch) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 1))  # 6 tensors
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    applied = apply(model, optimizer, stage=1, checkpointing=False, device=torch.device("cpu"))
    sources: list[Any] = []
    broadcast = dist.broadcast

    def counted(tensor: torch.Tensor, src: Any = None, *args: Any, **kwargs: Any) -> Any:
        sources.append(kwargs.get("src", src))
        return broadcast(tensor, src, *args, **kwargs)

    applied.model(torch.randn(4, 8)).sum().backward()
    monkeypatch.setattr(dist, "broadcast", counted)
    applied.optimizer.step()
    assert sources == [0]  # the one rank's shard at once, not six parameters one by one
