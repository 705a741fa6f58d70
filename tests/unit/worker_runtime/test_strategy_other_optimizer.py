"""An optimizer built over ``run.model``'s parameters after ``prepare`` (an FSDP habit) is
refused where a stage rebuilt the optimizer: it would train without the stage's optimizer (the
whole state on every rank under ZeRO-1, an empty ``run.optimizer.state_dict()`` under ZeRO-2
and 3), and a trial would be recorded as a configuration it did not run. In a gloo world of
one rank, in this process."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distune.worker_runtime.strategy import StrategyError, apply


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_another_optimizer_over_the_prepared_model_is_refused(one_rank, stage) -> None:
    net = model()
    applied = apply(net, torch.optim.AdamW(net.parameters(), lr=0.1), stage, False,
                    torch.device("cpu"), blocks=(nn.Linear,))  # fmt: skip
    applied.model(torch.randn(4, 8)).sum().backward()
    applied.optimizer.step()  # the stage's own (ZeRO's inner optimizer steps inside it)
    own = torch.optim.AdamW(applied.model.parameters(), lr=0.1)
    with pytest.raises(StrategyError, match=r"call run\.optimizer\.step\(\), not the step of "
                       "another optimizer over run.model's parameters"):  # fmt: skip
        own.step()
    # Another model's optimizer (a GAN's other half) is not this stage's business.
    other = nn.Linear(2, 2)
    other(torch.randn(1, 2)).sum().backward()
    torch.optim.SGD(other.parameters(), lr=0.1).step()


def test_under_ddp_an_optimizer_built_after_prepare_trains_as_before(one_rank) -> None:
    net = model()
    applied = apply(net, torch.optim.SGD(net.parameters(), lr=0.1), 0, False, torch.device("cpu"))
    own = torch.optim.SGD(applied.model.parameters(), lr=0.1)
    applied.model(torch.randn(4, 8)).sum().backward()
    own.step()  # the same parameters and math: ddp keeps the script's optimizer anyway
