"""Fixtures shared by the integration tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def quick_service(start_service):
    """A real tuning service process with short warm-up and sampling times, without a token:
    a 2-rank job sees it sample and complete within seconds."""
    return start_service(
        "--warmup-time", "0.3", "--sampling-confidence-time", "0.3", "--max-samples", "4",
        token=None,
    )  # fmt: skip
