"""The leader's HTTP thread and the sync points, against a scripted HTTP service.

The real service cannot be told to hang, answer garbage or forget a model on cue; this small
HTTP server can, so these tests drive the client through every failure the runtime must survive.
The real service is exercised in tests/integration/test_ddp_service.py.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import distune
from distune import Hyperparameters
from distune.space import FixedKnobs, ModelFacts, SearchSpace
from distune.worker_runtime import distributed
from distune.worker_runtime.leader_client import (
    ClientConfig,
    LeaderClient,
    ServiceAnswer,
    WindowReport,
)
from distune.worker_runtime.model_names import NameRegistry

FACTS = ModelFacts(world_size=2, nnodes=1, local_world_size=2, gradient_bytes=2**20)
SPACE = SearchSpace.for_model(FACTS)
FAST = ClientConfig(connect_timeout=0.5, read_timeout=0.5, initial_backoff=0.05, max_backoff=0.2)
TOKEN = "s3cr3t-token"
LOGGER = "distune.worker_runtime.leader_client"


def group(group_id: int, hp: Hyperparameters) -> dict[str, Any]:
    return {"id": group_id, "hyperparameters": hp.to_dict()}


class ScriptedService:
    """An HTTP server whose answers come from ``respond(action, body) -> (status, payload)``.

    ``payload`` is JSON-encoded unless it is bytes. Every request is recorded.
    """

    def __init__(self) -> None:
        self.requests: list[tuple[str, dict[str, str], Any]] = []
        self.respond: Callable[[str, Any], tuple[int, Any]] = self.normal
        self.current = group(1, SPACE.default)
        self.delay = 0.0
        service = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                action = self.path.rsplit("/", 1)[-1]
                service.requests.append((self.path, dict(self.headers), body))
                time.sleep(service.delay)
                status, payload = service.respond(action, body)
                data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up waiting (the slow-service test)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )

    def normal(self, action: str, body: Any) -> tuple[int, Any]:
        if action == "report" and body["group_id"] != self.current["id"]:
            return 409, {"error": "stale", "group": self.current, "state": "sampling",
                         "completed": False}  # fmt: skip
        return 200, {"group": self.current, "state": "sampling", "completed": False}

    def actions(self) -> list[str]:
        return [path.rsplit("/", 1)[-1] for path, _, _ in self.requests]

    def __enter__(self) -> ScriptedService:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def wait_for(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def client_for(url: str, token: str | None = None, fixed: FixedKnobs | None = None) -> LeaderClient:
    return LeaderClient(url, token, "net", FACTS, fixed or FixedKnobs(), SPACE, FAST)


def report(group_id: int, train_iter: int = 10) -> WindowReport:
    return WindowReport(group_id=group_id, train_iter=train_iter, iterations=5, seconds=0.5)


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_registers_reports_and_follows_the_current_group():
    with ScriptedService() as service:
        client = client_for(service.url, TOKEN, FixedKnobs(bucket_size_2p=18))
        client.start()
        wait_for(lambda: client.latest() is not None)
        assert client.latest() == ServiceAnswer(1, SPACE.default, "sampling", False)
        path, headers, body = service.requests[0]
        assert path == "/api/v1/models/net/register"
        assert headers["Authorization"] == f"Bearer {TOKEN}"
        assert body == {"world_size": 2, "nnodes": 1, "local_world_size": 2,
                        "gradient_bytes": 2**20, "fixed": {"bucket_size_2p": 18}}  # fmt: skip
        service.current = group(2, Hyperparameters(17, False))
        client.report(report(1))
        wait_for(lambda: client.latest().group_id == 2)
        assert service.requests[1][2] == report(1).to_json()
        # A report for the old group is answered 409 with the current group: adopted quietly.
        service.current = group(3, Hyperparameters(19, False))
        client.report(report(2))
        wait_for(lambda: client.latest().group_id == 3)
        client.close()
        wait_for(lambda: not client.alive)


def test_the_leader_reaches_the_service_directly_whatever_proxy_is_set(monkeypatch):
    # A cluster's http_proxy (no no_proxy): the leader's requests went to the proxy, which
    # cannot reach the job's service, with the token in their headers.
    for name in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    with ScriptedService() as service:
        client = client_for(service.url, TOKEN)
        client.start()
        wait_for(lambda: client.latest() is not None)
        client.close()
        assert service.requests[0][1]["Authorization"] == f"Bearer {TOKEN}"


def test_no_fixed_object_and_no_token_header_when_none_is_set():
    with ScriptedService() as service:
        client = client_for(service.url)
        client.start()
        wait_for(lambda: client.latest() is not None)
        client.close()
        _, headers, body = service.requests[0]
        assert "fixed" not in body and "Authorization" not in headers


def test_completed_is_passed_on():
    with ScriptedService() as service:
        service.respond = lambda action, body: (
            200,
            {"group": service.current, "state": "completed"},
        )
        client = client_for(service.url)
        client.start()
        wait_for(lambda: client.latest() is not None)
        assert client.latest().completed
        client.close()


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"<html>oops</html>", "not JSON"),
        ({"group": {"id": "one"}, "state": "sampling"}, "garbage"),
        ({"group": group(1, Hyperparameters(17, False))}, "garbage"),  # no state
        ({"group": {"id": 1, "hyperparameters": {"bucket_size_2p": 17}}, "state": "x"}, "garbage"),
        ({"group": group(1, Hyperparameters(40, False)), "state": "x"}, "outside"),
    ],
)
def test_garbage_is_one_warning_and_retried(caplog, payload, reason):
    with ScriptedService() as service:
        service.respond = lambda action, body: (200, payload)
        client = client_for(service.url)
        with caplog.at_level(logging.DEBUG, logger=LOGGER):
            client.start()
            wait_for(lambda: len(service.requests) >= 3)  # retried with back-off
            service.respond = service.normal
            wait_for(lambda: client.latest() is not None)
            client.close()
    warnings = warnings_of(caplog)
    assert len(warnings) == 2, warnings  # the outage, then the recovery
    assert reason in warnings[0] and "keeps training with bucket 2^" in warnings[0]
    assert "answers again" in warnings[1]


def test_a_refused_token_says_which_variable_and_never_logs_the_token(caplog):
    with ScriptedService() as service:
        service.respond = lambda action, body: (401, {"error": "unauthorized"})
        client = client_for(service.url, TOKEN)
        with caplog.at_level(logging.DEBUG, logger=LOGGER):
            client.start()
            wait_for(lambda: len(service.requests) >= 3)
            client.close()
    warnings = warnings_of(caplog)
    assert len(warnings) == 1 and "DISTUNE_SERVICE_TOKEN" in warnings[0]
    assert all(TOKEN not in record.getMessage() for record in caplog.records)
    assert client.latest() is None


def test_unreachable_service_warns_once_and_never_blocks_the_caller(caplog):
    with ScriptedService() as service:
        url = service.url  # a port nothing listens on once the server is closed
    client = client_for(url)
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        client.start()
        started = time.perf_counter()
        for i in range(100):
            client.report(report(1, i))  # more than the queue holds: the oldest are dropped
            assert client.latest() is None
        assert time.perf_counter() - started < 0.5
        time.sleep(0.5)  # several retries
        client.close()
    warnings = warnings_of(caplog)
    assert len(warnings) == 1 and "cannot be reached" in warnings[0]


def test_a_slow_service_times_out_without_blocking_the_caller(caplog):
    with ScriptedService() as service:
        service.delay = 1.0  # above the read timeout
        client = client_for(service.url)
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            client.start()
            started = time.perf_counter()
            client.report(report(1))
            client.latest()
            assert time.perf_counter() - started < 0.1
            wait_for(lambda: warnings_of(caplog), timeout=3)
            client.close()
    assert "did not answer in time" in warnings_of(caplog)[0]


def test_a_service_that_forgot_the_model_gets_it_registered_again():
    with ScriptedService() as service:
        client = client_for(service.url)
        client.start()
        wait_for(lambda: client.latest() is not None)
        service.respond = lambda action, body: (
            (404, {"error": "unknown model"})
            if action == "report"
            else service.normal(action, body)
        )
        client.report(report(1))
        wait_for(lambda: service.actions()[-1:] == ["register"] and len(service.requests) >= 3)
        client.close()
    assert service.actions()[:3] == ["register", "report", "register"]


def superseded(service: ScriptedService, action: str, body: Any) -> tuple[int, Any]:
    """A service on which a registration with other facts replaced the client's."""
    if action == "report":
        return 409, {"error": "group_id: group 1 is of model 'net' as registered with ..., "
                     "since registered again with other facts", "group": group(1, SPACE.default),
                     "state": "superseded", "completed": True}  # fmt: skip
    return service.normal(action, body)


def test_a_replaced_registration_says_so_once_and_stops_tuning(caplog):
    # Another model took the name with other facts while this one trains: two models, one name.
    with ScriptedService() as service:
        client = client_for(service.url)
        with caplog.at_level(logging.DEBUG, logger=LOGGER):
            client.start()
            wait_for(lambda: client.latest() is not None)
            service.respond = lambda action, body: superseded(service, action, body)
            client.report(report(1))
            wait_for(lambda: client.refused and not client.alive)
            client.report(report(1, train_iter=20))
            time.sleep(0.1)
    assert service.actions() == ["register", "report"], "no retry, no registration again"
    [warning] = warnings_of(caplog)
    assert warning.startswith(f"tuning service at {service.url} no longer tunes model 'net': ")
    assert "registered again with other facts" in warning and "it keeps bucket 2^" in warning


def test_a_closed_client_replaced_by_its_own_process_stops_quietly(caplog):
    with ScriptedService() as service:
        client = client_for(service.url)
        client.start()
        wait_for(lambda: client.latest() is not None)
        service.delay = 0.2
        service.respond = lambda action, body: superseded(service, action, body)
        with caplog.at_level(logging.DEBUG, logger=LOGGER):
            client.report(report(1))
            wait_for(lambda: service.actions()[-1:] == ["report"])
            client.close()  # the report is in flight: this process wrapped the model again
            client.wait_ended(5)
    assert client.refused and warnings_of(caplog) == []


def test_a_client_started_after_a_replaced_one_registers_after_its_last_report():
    # Registered first, the old wrapper's in-flight report would reach the service after the
    # new registration, which would take it for a second model under the name.
    done: list[str] = []
    with ScriptedService() as service:

        def respond(action: str, body: Any) -> tuple[int, Any]:
            if action == "report":
                time.sleep(0.3)
            done.append(f"{action} {body.get('gradient_bytes', '')}".strip())
            return service.normal(action, body)

        service.respond = respond
        old = client_for(service.url)
        old.start()
        wait_for(lambda: old.latest() is not None)
        old.report(report(1))
        wait_for(lambda: service.actions()[-1:] == ["report"])
        old.close()
        unfrozen = replace(FACTS, gradient_bytes=2**22)
        new = LeaderClient(service.url, None, "net", unfrozen, FixedKnobs(),
                           SearchSpace.for_model(unfrozen), FAST)  # fmt: skip
        new.start(after=old)
        wait_for(lambda: new.latest() is not None)
        new.close()
    assert done == [f"register {2**20}", "report", f"register {2**22}"]


# -- sync points, driven through the public wrapper in a world of one -----------------------


@pytest.fixture
def tuning_world(monkeypatch):
    # Names as in a fresh process: a wrapper an earlier test keeps alive (a failed test's
    # traceback holds its frames) must not number this test's models on.
    monkeypatch.setattr(distributed, "NAMES_IN_USE", NameRegistry())

    def start(url: str) -> None:
        monkeypatch.setenv("DISTUNE_AUTOTUNE_LEVEL", "1")
        monkeypatch.setenv("DISTUNE_SERVICE_URL", url)
        monkeypatch.setenv("DISTUNE_SYNC_INTERVAL", "0.02")
        for name in ("DISTUNE_BUCKET_SIZE", "DISTUNE_HIERARCHICAL_REDUCE", "DISTUNE_SERVICE_TOKEN"):
            monkeypatch.delenv(name, raising=False)
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)

    yield start
    if dist.is_initialized():
        dist.destroy_process_group()


def train_until(
    model: nn.Module, condition: Callable[[], bool], seen: list | None = None, timeout: float = 10.0
) -> list:
    """Train step by step until ``condition``; add (iteration, hyperparameters) per step to
    ``seen`` and return it."""
    seen = [] if seen is None else seen
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        model(torch.randn(4, 64)).sum().backward()
        seen.append((model._reducer.iterations, model.hyperparameters))
        time.sleep(0.002)
    return seen


def test_sync_points_report_windows_and_apply_the_services_groups(tuning_world):
    with ScriptedService() as service:
        tuning_world(service.url)
        model = distune.DistributedDataParallel(nn.Linear(64, 2048))  # 2^19+ bytes: top 2^20
        assert model.hyperparameters == Hyperparameters(20, False)
        service.current = group(1, Hyperparameters(20, False))
        seen = train_until(model, lambda: "report" in service.actions())
        switched = Hyperparameters(17, False)
        service.current = group(2, switched)
        train_until(model, lambda: model.hyperparameters == switched, seen)
        train_until(
            model, lambda: any(b["group_id"] == 2 for _, _, b in service.requests[1:]), seen
        )
        service.current = group(2, switched)
        service.respond = lambda action, body: (
            200,
            {"group": service.current, "state": "completed", "completed": True},
        )
        train_until(model, lambda: model._sync.stopped)
        reports = [body for _, _, body in service.requests if "group_id" in body]
    assert model.hyperparameters == switched
    assert [r["group_id"] for r in reports] == sorted(r["group_id"] for r in reports)
    ends = [r["train_iter"] for r in reports]
    assert ends == sorted(ends) and all(r["iterations"] >= 1 for r in reports)
    assert all(r["seconds"] > 0 for r in reports)
    groups = [hp for _, hp in seen]
    assert groups[0] == Hyperparameters(20, False) and groups[-1] == switched
    assert groups == sorted(groups, key=lambda hp: hp == switched)  # one switch, no way back


def test_level_zero_starts_no_thread_and_sends_nothing(tuning_world, monkeypatch):
    with ScriptedService() as service:
        tuning_world(service.url)
        monkeypatch.setenv("DISTUNE_AUTOTUNE_LEVEL", "0")
        model = distune.DistributedDataParallel(nn.Linear(64, 8))
        for _ in range(20):
            model(torch.randn(4, 64)).sum().backward()
        time.sleep(0.1)
    assert service.requests == []
    assert model._sync is None


def test_set_hyperparameters_stops_tuning(tuning_world):
    with ScriptedService() as service:
        tuning_world(service.url)
        model = distune.DistributedDataParallel(nn.Linear(64, 8))  # its space: 2^16 only
        service.current = group(1, Hyperparameters(16, False))
        train_until(model, lambda: "report" in service.actions())
        model.set_hyperparameters(Hyperparameters(10, False))
        assert model._sync.stopped
        service.current = group(5, Hyperparameters(16, False))
        for _ in range(30):
            model(torch.randn(4, 64)).sum().backward()
    assert model.hyperparameters == Hyperparameters(10, False)


@pytest.mark.parametrize(
    ("out_features", "bucket_cap_mb", "warned"),
    [(2048, 25, True), (2048, None, False), (8, 25, False)],  # (8: one group either way)
)
def test_a_bucket_cap_that_leaves_nothing_to_tune_says_so(
    tuning_world, caplog, out_features, bucket_cap_mb, warned
):
    with ScriptedService() as service:
        tuning_world(service.url)
        with caplog.at_level(logging.WARNING, logger="distune.worker_runtime.distributed"):
            distune.DistributedDataParallel(
                nn.Linear(64, out_features), bucket_cap_mb=bucket_cap_mb
            )
    said = [m for m in warnings_of(caplog) if "pins the bucket size" in m]
    assert said == (
        [
            "model 'model0': its constructor pins the bucket size (bucket_cap_mb or bucket_size), "
            "the only knob this job could tune: --autotune_level 1 measures one group and "
            "changes nothing; leave bucket_cap_mb out to let distune tune the bucket size"
        ]
        if warned
        else []
    )


def test_a_comm_hook_that_stops_tuning_says_so(tuning_world, caplog):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    with ScriptedService() as service:
        tuning_world(service.url)
        model = distune.DistributedDataParallel(nn.Linear(64, 2048))
        with caplog.at_level(logging.WARNING, logger="distune.worker_runtime.distributed"):
            model.register_comm_hook(None, allreduce_hook)
    assert model._sync.stopped
    assert [m for m in warnings_of(caplog) if "stops tuning" in m] == [
        "register_comm_hook: model 'model0' stops tuning and keeps bucket 2^20 B (1 MiB), flat "
        "(a hook may keep state per bucket, as PowerSGD does, which a new bucket size would "
        "break)"
    ]
