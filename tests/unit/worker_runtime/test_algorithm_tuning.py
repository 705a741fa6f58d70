"""Tuning with algorithms: only the knobs an algorithm uses are tuned; the algorithm never
changes. Driven through the public wrapper in a world of one, against the scripted service of
test_worker_tuning."""

from __future__ import annotations

import time

import torch
from test_worker_tuning import ScriptedService, group, train_until, tuning_world
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import distune
from distune import Hyperparameters
from distune.algorithms import AsyncModelAverage, Decentralized, LowPrecision

__all__ = ["tuning_world"]  # the fixture, imported for pytest


def _register_body(service: ScriptedService) -> dict:
    (body,) = [body for path, _, body in service.requests if path.endswith("register")][:1]
    return body


def test_low_precision_tunes_bucket_size_and_pins_hierarchical(tuning_world):
    with ScriptedService() as service:
        tuning_world(service.url)
        service.current = group(1, Hyperparameters(16, False))
        model = distune.DistributedDataParallel(nn.Linear(64, 8), algorithm=LowPrecision())
        train_until(model, lambda: "report" in service.actions())
        body = _register_body(service)
    assert body["fixed"] == {"is_hierarchical_reduce": False}  # bucket size stays tuned
    assert model.algorithm == LowPrecision()


def test_model_averaging_algorithms_tune_nothing(tuning_world):
    with ScriptedService() as service:
        tuning_world(service.url)
        for algorithm in (Decentralized(), AsyncModelAverage(interval_seconds=0.0)):
            model = distune.DistributedDataParallel(nn.Linear(64, 8), algorithm=algorithm)
            for _ in range(20):
                model(torch.randn(4, 64)).sum().backward()
            model.finish()
            assert model._sync is None
            assert model.algorithm is algorithm
        time.sleep(0.1)
    assert service.requests == []  # nothing to tune: the service never hears of them


def test_a_comm_hook_stops_tuning_and_keeps_the_buckets(tuning_world):
    with ScriptedService() as service:
        tuning_world(service.url)
        service.current = group(1, Hyperparameters(16, False))
        model = distune.DistributedDataParallel(nn.Linear(64, 8))
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        assert model._sync is not None and model._sync.stopped
        service.current = group(5, Hyperparameters(17, False))
        for _ in range(30):
            model(torch.randn(4, 64)).sum().backward()
    assert model.hyperparameters == Hyperparameters(16, False)
