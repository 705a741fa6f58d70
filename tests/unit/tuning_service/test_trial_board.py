"""The service's level-2 trial board, driven by scripted requests over its REST API (WSGI, no
sockets): the state machine of a two-node tuning, and the errors a confused node gets."""

from __future__ import annotations

import pytest

from distune.tuning_service.app import create_app
from distune.tuning_service.service import TuningService
from distune.tuning_service.trial_board import OUTCOME_PRIORITY

TOKEN = "trial-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
KNOBS = {"micro_batch": 4, "accumulation": 2, "stage": 1, "checkpointing": False, "bf16": False}
CONFIG = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}
MEASURED = {"throughput": 120.0, "step_seconds": 0.25, "peak_memory_bytes": 2**24}


@pytest.fixture
def client():
    return create_app(TuningService(), token=TOKEN).test_client()


def call(client, method: str, path: str, body=None, status: int = 200):
    response = client.open(f"/api/v1/trials{path}", method=method, json=body, headers=AUTH)
    assert response.status_code == status, response.get_json()
    return response.get_json()


def spec(trial: int, nnodes: int = 2, **extra):
    return {
        "trial": trial,
        "nnodes": nnodes,
        "purpose": "search",
        "knobs": KNOBS,
        "master_port": 29600 + trial,
        "config": CONFIG,
        **extra,
    }


def node(outcome: str = "ok", **extra):
    return {"outcome": outcome, "duration": 12.5, **extra}


def record(trial: int, outcome: str = "ok", throughput: float | None = 120.0):
    return {"trial": trial, "config": CONFIG, "outcome": outcome, "throughput": throughput}


def test_a_two_node_tuning_from_first_trial_to_the_choice(client):
    assert call(client, "GET", "/current")["state"] == "waiting"
    published = call(client, "POST", "", spec(0, purpose="profile"))
    assert (published["state"], published["missing"], published["combined"]) == (
        "running",
        [0, 1],
        None,
    )
    # Node 1 asks what to run; it gets the trial, with its knobs and rendezvous port.
    current = call(client, "GET", "/current?node_rank=1")
    assert current["state"] == "tuning" and current["trial"]["spec"]["master_port"] == 29600
    assert current["acknowledged"] == []  # nothing to acknowledge before the end
    node1 = call(client, "POST", "/0/nodes/1", node(peak_memory_bytes=2**25))
    assert (node1["state"], node1["missing"], node1["failed"]) == ("running", [0], False)
    both = call(client, "POST", "/0/nodes/0", node(measurements=MEASURED, peak_memory_bytes=2**24))
    assert both["state"] == "reported"
    assert both["combined"]["outcome"] == "ok"
    assert both["combined"]["measurements"] == MEASURED
    assert both["combined"]["peak_memory_bytes"] == 2**25  # the highest of any node
    # Recorded, it shows in the overview (what `distune status` and the dashboard read).
    assert call(client, "POST", "/0/record", record(0))["state"] == "recorded"
    call(client, "POST", "", spec(1))
    call(client, "POST", "/1/nodes/0", node("oom", error="OutOfMemoryError", stopped=True))
    call(client, "POST", "/1/nodes/1", node("oom", error="OutOfMemoryError: over the cap"))
    call(client, "POST", "/1/record", record(1, "oom", None))
    overview = call(client, "GET", "")
    assert [t["outcome"] for t in overview["trials"]] == ["ok", "oom"]
    assert (overview["state"], overview["nnodes"], overview["best"]) == ("tuning", 2, 0)
    # The end: node 1 learns the choice, and node 0 sees that it did.
    finish = {"mode": "run", "chosen": 0, "knobs": KNOBS}
    assert call(client, "POST", "/finish", finish)["state"] == "finished"
    assert call(client, "GET", "/current")["acknowledged"] == []
    seen = call(client, "GET", "/current?node_rank=1")
    assert seen["finish"] == finish and seen["acknowledged"] == [1]
    call(client, "POST", "/finish", finish)  # a retried request is answered the same
    refused = call(client, "POST", "", spec(2), status=409)
    assert "the trials are finished" in refused["error"]


@pytest.mark.parametrize(
    ("reports", "outcome", "error"),
    [
        # The node that ran out of memory explains its peers' crashes, whatever came first.
        ([(1, node("crash", error="gloo: peer closed")), (0, node("oom", error="OOM"))], "oom", "node 0: OOM"),
        ([(0, node("ok")), (1, node("timeout", error="hung"))], "timeout", "node 1: hung"),
        ([(0, node("crash", error="first")), (1, node("crash", error="second"))], "crash", "node 0: first"),
        # Node 1's rank raised; node 0's then failed in its collective with it, and reported
        # first: the node that failed first is the cause (each report says when, by its clock).
        ([(0, node("crash", error="gloo: Connection closed by peer", failed_at=1000.9)),
          (1, node("crash", error="ValueError: corrupt shard", failed_at=1000.2))],
         "crash", "node 1: ValueError: corrupt shard"),
        ([(0, node("crash", error="no time")), (1, node("crash", error="timed", failed_at=5.0))], "crash", "node 1: timed"),
        ([(0, node("crash", error="NaN", diverged=True)), (1, node("crash", error="peer", failed_at=9.0))], "crash", "node 1: peer"),
        ([(0, node("ok")), (1, node("invalid", error="no steps"))], "invalid", "node 1: no steps"),
        # A node stopped because of its peer is a symptom: the peer's outcome counts.
        ([(0, node("oom", stopped=True)), (1, node("crash", error="bug"))], "crash", "node 1: bug"),
        ([(0, node("crash", error="x", stopped=True)), (1, node("timeout", error="y", stopped=True))], "timeout", "node 1: y"),
    ],
)  # fmt: skip
def test_the_trials_outcome_is_the_most_telling_of_its_nodes(client, reports, outcome, error):
    call(client, "POST", "", spec(0))
    for node_rank, report in reports:
        view = call(client, "POST", f"/0/nodes/{node_rank}", report)
    assert view["combined"]["outcome"] == outcome
    assert view["combined"]["error"] == error
    # Whether the trial diverged is the explaining node's say (its ranks' NaN check).
    explaining = dict(reports)[view["combined"]["node"]]
    assert view["combined"]["diverged"] is (
        outcome == "crash" and explaining.get("diverged", False)
    )
    assert OUTCOME_PRIORITY[0] == "oom" and OUTCOME_PRIORITY[-1] == "ok"


def test_a_failed_node_is_visible_to_its_peers_before_the_trial_is_reported(client):
    call(client, "POST", "", spec(0))
    view = call(client, "POST", "/0/nodes/1", node("crash", error="Traceback ..."))
    assert view["failed"] is True and view["state"] == "running"
    # A node stopped because of that failure does not count as a failure of its own.
    call(client, "POST", "", spec(1, nnodes=2), status=409)  # trial 0 is not recorded yet
    stopped = call(client, "POST", "/0/nodes/0", node("crash", stopped=True))
    assert stopped["combined"]["error"] == "node 1: Traceback ..."


def test_node_0_closes_a_trial_a_node_never_reported_and_late_reports_are_refused(client):
    call(client, "POST", "", spec(0))
    call(client, "POST", "/0/nodes/0", node("timeout", error="no step"))
    closed = call(client, "POST", "/0/record", record(0, "timeout", None))
    assert closed["state"] == "recorded" and closed["missing"] == [1]
    late = call(client, "POST", "/0/nodes/1", node("ok"), status=409)
    assert "recorded already (outcome timeout)" in late["error"]
    assert "came too late" in late["error"]


def test_a_stop_from_any_node_reaches_every_node(client):
    call(client, "POST", "", spec(0))
    overview = call(client, "POST", "/stop", {"node_rank": 1, "reason": "SIGINT"})
    assert overview["state"] == "stopped"
    assert overview["stop"] == {"node_rank": 1, "reason": "SIGINT"}
    current = call(client, "GET", "/current?node_rank=0")
    # Node 1 stopped the trials: it knows; node 0 has now seen it.
    assert current["stop"]["reason"] == "SIGINT" and current["acknowledged"] == [0, 1]
    # The first stop's reason is kept; nothing new may start.
    call(client, "POST", "/stop", {"node_rank": 0, "reason": "SIGTERM"})
    assert call(client, "GET", "/current")["stop"]["reason"] == "SIGINT"
    assert "stopped" in call(client, "POST", "/1/record", record(1), status=409)["error"]


def test_a_resumed_trial_is_recorded_without_any_node_running_it(client):
    view = call(client, "POST", "/0/record", record(0))
    assert view["spec"] is None and view["state"] == "recorded"
    refused = call(client, "POST", "/0/nodes/0", node(), status=409)
    assert "reused from an earlier tuning" in refused["error"]
    call(client, "POST", "", spec(1))
    assert call(client, "GET", "")["trials"] == [record(0)]


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "message"),
    [
        ("POST", "", {**spec(0), "knobs": {"micro_batch": 0}}, 400, "knobs.micro_batch: must be in [1,"),
        ("POST", "", {**spec(0), "knobs": {"zero": 1}}, 400, "knobs.zero: unknown field; allowed fields are micro_batch, accumulation, stage, checkpointing, bf16"),
        ("POST", "", {**spec(0), "master_port": 70000}, 400, "master_port: must be in [1, 65535]"),
        ("POST", "", {**spec(0), "purpose": "Search!"}, 400, "purpose: must match"),
        ("POST", "", {k: v for k, v in spec(0).items() if k != "nnodes"}, 400, "nnodes: missing"),
        ("POST", "", [spec(0)], 400, "body: must be a JSON object, got list"),
        ("POST", "", {**spec(0), "metric": "speed"}, 400, "metric: must be one of throughput, latency"),
        ("GET", "/7", None, 404, "no trial 7 was published; there are trials 0 to 0"),
        ("POST", "/7/nodes/0", node(), 404, "no trial 7 was published"),
        ("POST", "/0/nodes/2", node(), 400, "node_rank: this trial runs on 2 nodes (node ranks 0 to 1), got 2"),
        ("POST", "/0/nodes/0", node("fine"), 400, "outcome: must be one of ok, oom, timeout, crash, invalid"),
        ("POST", "/0/nodes/0", {"outcome": "ok"}, 400, "duration: missing"),
        ("POST", "/0/nodes/0", node(stopped="yes"), 400, "stopped: must be true or false"),
        ("POST", "/0/nodes/0", node(failed_at="now"), 400, "failed_at: must be a number"),
        ("POST", "/0/nodes/0", node(diverged=1), 400, "diverged: must be true or false"),
        ("POST", "/0/record", record(3), 400, "trial: the record is of trial 3, posted to 0"),
        ("POST", "/0/record", {"trial": 0}, 400, "outcome: missing"),
        ("POST", "/0/record", {**record(0), "step_seconds": "fast"}, 400, "step_seconds: must be a number"),
        ("POST", "/0/record", {**record(0), "error": ["x"]}, 400, "error: must be a string or null"),
        ("POST", "/0/record", {**record(0), "peak_memory_bytes": 1.5}, 400, "peak_memory_bytes: must be an integer"),
        ("POST", "", spec(1), 409, "trial 0 is still running (nodes [0, 1] to report)"),
        ("POST", "/finish", {"mode": "run", "chosen": 0}, 400, "give both chosen and knobs"),
        ("POST", "/finish", {"mode": "run"}, 409, "trial 0 is still running"),
        ("POST", "/stop", {"node_rank": 5, "reason": "x"}, 400, "node ranks 0 to 1"),
        ("GET", "/current?node_rank=x", None, 400, "node_rank: must be a node rank"),
        ("GET", "/current?node_rank=%C2%B2", None, 400, "node_rank: must be a node rank"),
        ("GET", "/current?node_rank=12345678901", None, 400, "node_rank: must be a node rank"),
        ("GET", "/current?node_rank=3", None, 400, "node_rank: this trial runs on 2 nodes"),
        ("GET", "/current?node=1", None, 400, "'node': unknown query parameter; the one allowed is node_rank"),
    ],
)  # fmt: skip
def test_bad_trial_requests_get_a_4xx_naming_what_is_wrong(
    client, method, path, body, status, message
):
    call(client, "POST", "", spec(0))
    answer = call(client, method, path, body, status=status)
    assert message in answer["error"], answer


def test_a_trial_asked_for_before_any_was_published_is_a_404_saying_so(client):
    answer = call(client, "POST", "/finish", {"mode": "run", "chosen": 5, "knobs": {}}, status=404)
    assert answer["error"] == "no trial 5 was published; none was yet"


def test_the_board_refuses_out_of_turn_requests(client):
    call(client, "POST", "", spec(0))
    assert "nnodes" in call(client, "POST", "", spec(0, nnodes=3), status=409)["error"]
    call(client, "POST", "/0/nodes/0", node())
    # The same report again is a retry; a different one is a conflict.
    call(client, "POST", "/0/nodes/0", node())
    twice = call(client, "POST", "/0/nodes/0", node("crash"), status=409)
    assert "node 0 reported trial 0 already (outcome ok)" in twice["error"]
    call(client, "POST", "/0/nodes/1", node())
    call(client, "POST", "/0/record", record(0, "oom", None))
    assert "above 0" in call(client, "POST", "", spec(0, purpose="again"), status=409)["error"]
    chosen = call(
        client, "POST", "/finish", {"mode": "tune", "chosen": 0, "knobs": KNOBS}, status=409
    )
    assert "trial 0 ended oom; only an ok trial can be chosen" in chosen["error"]
    unknown = {"mode": "tune", "chosen": 9, "knobs": KNOBS}
    assert "no trial 9" in call(client, "POST", "/finish", unknown, status=404)["error"]


def test_trial_endpoints_need_the_token(client):
    for method, path in (("GET", ""), ("GET", "/current"), ("POST", ""), ("POST", "/stop")):
        response = client.open(f"/api/v1/trials{path}", method=method, json={})
        assert response.status_code == 401
