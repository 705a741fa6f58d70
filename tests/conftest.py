"""Fixtures every part of the suite shares; their helpers live in the tests.support package."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.support.service_process import ServiceProcess


def pytest_configure(config: pytest.Config) -> None:
    """One intra-op thread in this process, as every rank of a job gets (torchrun's
    OMP_NUM_THREADS=1, ddp_launch's set_num_threads(1)). The tests' tensors are small: a second
    thread only makes each op wait for it, worst on a loaded machine (3.5x the time of
    test_fused_optimizer at load 2.7, up to 10 s a test in a full run)."""
    import torch  # here, not at the top: a conftest import would load torch for every tool

    torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (``make test`` runs two workers with ``--dist loadgroup``) the slow
    tests stay together on one worker, in order: each starts a job of several processes, and
    their time margins are set for one such job at a time. The fast tests, which take a
    fifth of the suite's time, run on the other worker meanwhile."""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        if item.get_closest_marker("slow") is not None:
            item.add_marker(pytest.mark.xdist_group("slow"))


@pytest.fixture
def start_service() -> Iterator[Callable[..., ServiceProcess]]:
    """Start tuning service processes (``start_service(*flags, token=...)``); every one still
    running at the end of the test is stopped."""
    services: list[ServiceProcess] = []

    def start(*args: str, **kwargs: object) -> ServiceProcess:
        services.append(ServiceProcess(*args, **kwargs))  # type: ignore[arg-type]
        return services[-1]

    yield start
    for service in services:
        if service.process.returncode is None:
            service.stop()
