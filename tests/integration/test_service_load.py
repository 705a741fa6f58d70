"""A short version of the service load test (benchmarks/service_load.py, issue 6): a real
service process on loopback, 64 clients (one model each) reporting and polling, and status
readers, at once. Nothing is timed here; errors and memory are checked."""

import pytest
from benchmarks.service_load import load

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]


def test_sixty_four_models_reporting_and_polling_get_no_error():
    result = load(seconds=6.0, clients=64, readers=2, hz=10.0, processes=2)
    assert result["errors"] == 0, result["error_examples"]
    statuses = result["statuses"]
    assert statuses["register 200"] == 64
    # Every client got answers all along (a saturated machine slows them, never fails them).
    assert statuses["report 200"] >= 64 * 10
    assert statuses["hyperparameters 200"] >= 64 * 10
    assert statuses["status 200"] >= 2 * 10
    assert sum(result["states"].values()) == 64
    # A leak of even a few hundred bytes a request would show over ~8,000 requests.
    assert result["rss_mib"]["growth_last_two_thirds"] < 16
