"""Fixtures every part of the suite shares; their helpers live in the tests.support package."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.support.service_process import ServiceProcess


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
