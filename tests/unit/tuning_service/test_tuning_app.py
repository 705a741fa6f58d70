"""The REST API v1 through Flask's test client: behaviour, errors, auth."""

import json

import pytest

import distune
from distune.space import FixedKnobs
from distune.tuning_service.app import MAX_BODY_BYTES, create_app
from distune.tuning_service.config import TuningConfig
from distune.tuning_service.service import TuningService
from tests.support.models import MULTI_NODE_LARGE_REGISTRATION as REGISTRATION

CONFIG = TuningConfig(
    max_samples=6, sampling_confidence_time=2.0, min_windows=2, warmup_time=0.0, seed=1
)


def make_client(config=CONFIG, token=None, **service_kwargs):
    service = TuningService(config, **service_kwargs)
    return create_app(service, token=token).test_client()


@pytest.fixture
def client():
    return make_client()


def register(client, name="m", **overrides):
    response = client.post(f"/api/v1/models/{name}/register", json={**REGISTRATION, **overrides})
    assert response.status_code == 200, response.get_json()
    return response.get_json()


def report(client, name="m", **fields):
    body = {"group_id": 0, "train_iter": 10, "iterations": 10, "seconds": 1.0, **fields}
    return client.post(f"/api/v1/models/{name}/report", json=body)


def test_health_names_the_version(client):
    response = client.get("/api/v1/health")
    assert response.status_code == 200
    assert response.get_json() == {"status": "ok", "version": distune.__version__}


def test_register_hands_out_the_default_group(client):
    assert register(client) == {
        "group": {
            "id": 0,
            "hyperparameters": {"bucket_size_2p": 25, "is_hierarchical_reduce": False},
        },
        "state": "sampling",
        "completed": False,
    }


def test_report_and_hyperparameters_answer_the_current_group(client):
    register(client)
    response = report(client)
    assert response.status_code == 200
    assert response.get_json()["group"]["id"] == 0
    answer = client.get("/api/v1/models/m/hyperparameters").get_json()
    assert answer == response.get_json()


def test_a_full_run_over_the_api_completes_and_shows_in_status_log_and_best_file(tmp_path):
    best = tmp_path / "best.json"
    client = make_client(best_path=best)
    group = register(client)["group"]
    step = 0
    while True:
        step += 1
        bucket = group["hyperparameters"]["bucket_size_2p"]
        rate = 100.0 + 10.0 * (bucket == 22)
        reply = report(
            client, group_id=group["id"], train_iter=step, iterations=100, seconds=100 / rate
        ).get_json()
        group = reply["group"]
        if reply["completed"]:
            break
    status = client.get("/api/v1/status").get_json()["models"]["m"]
    assert status["state"] == "completed"
    assert 1 <= status["samples"] <= status["max_samples"] == 6
    assert status["current"] == group == status["best"]["group"]
    assert status["default_score"] == pytest.approx(100.0)
    chosen = json.loads(best.read_text())
    assert chosen["autotune_result"]["models"]["m"]["group"] == group
    assert chosen["bucket_size"] == 2 ** group["hyperparameters"]["bucket_size_2p"]
    log = client.get("/api/v1/models/m/log")
    assert log.status_code == 200 and log.mimetype == "text/csv"
    lines = log.get_data(as_text=True).splitlines()
    assert lines[0].startswith("bucket_size_2p,is_hierarchical_reduce,score,train_iter,")
    assert len(lines) == 1 + status["samples"] + 1  # header, samples, final choice


def test_two_models_are_tuned_independently(client):
    register(client, "a")
    register(client, "b", world_size=4, nnodes=1)
    for step in range(3):  # one discarded window, then two make a sample
        assert report(client, "a", train_iter=step).status_code == 200
    status = client.get("/api/v1/status").get_json()["models"]
    assert status["a"]["samples"] == 1 and status["a"]["current"]["id"] == 1
    assert status["b"]["samples"] == 0 and status["b"]["current"]["id"] == 0
    assert report(client, "b", group_id=0).status_code == 200  # b's group 0 is still current
    assert report(client, "a", group_id=0).status_code == 409


def test_stale_group_gets_409_with_the_current_group(client):
    register(client)
    response = report(client, group_id=3)
    assert response.status_code == 409
    body = response.get_json()
    assert "group_id" in body["error"]
    assert body["group"]["id"] == 0 and body["state"] == "sampling" and body["completed"] is False


def test_unknown_model_is_404(client):
    for response in (
        report(client, "nobody"),
        client.get("/api/v1/models/nobody/hyperparameters"),
        client.get("/api/v1/models/nobody/log"),
    ):
        assert response.status_code == 404
        assert "nobody" in response.get_json()["error"]


@pytest.mark.parametrize("name", ["a" * 65, "has space", "semi;colon", "ünï", ".", ".."])
def test_invalid_model_names_are_refused(client, name):
    response = client.post(f"/api/v1/models/{name}/register", json=REGISTRATION)
    assert response.status_code == 400
    assert "model names" in response.get_json()["error"]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"train_iter": 1, "iterations": 1, "seconds": 1.0}, "group_id"),
        ({"group_id": 0, "train_iter": 1, "iterations": 1}, "seconds"),
        ({"group_id": "0", "train_iter": 1, "iterations": 1, "seconds": 1.0}, "group_id"),
        ({"group_id": True, "train_iter": 1, "iterations": 1, "seconds": 1.0}, "group_id"),
        ({"group_id": 0, "train_iter": 1.5, "iterations": 1, "seconds": 1.0}, "train_iter"),
        ({"group_id": 0, "train_iter": 1, "iterations": 10.0, "seconds": 1.0}, "iterations"),
        ({"group_id": 0, "train_iter": 1, "iterations": 0, "seconds": 1.0}, "iterations"),
        ({"group_id": 0, "train_iter": -1, "iterations": 1, "seconds": 1.0}, "train_iter"),
        ({"group_id": 0, "train_iter": 1, "iterations": 1, "seconds": 0}, "seconds"),
        ({"group_id": 0, "train_iter": 1, "iterations": 1, "seconds": -2.0}, "seconds"),
        ({"group_id": 0, "train_iter": 1, "iterations": 1, "seconds": "1"}, "seconds"),
        ({"group_id": 0, "train_iter": 1, "iterations": 1, "seconds": 1e300}, "seconds"),
        ({"group_id": 0, "train_iter": 1, "iterations": 2**60, "seconds": 1.0}, "iterations"),
        (
            {"group_id": 0, "train_iter": 1, "iterations": 1, "seconds": 1.0, "samples": 0},
            "samples",
        ),
        ({"group_id": 0, "train_iter": 1, "iterations": 1, "seconds": 1.0, "x": 1}, "x"),
        ([1, 2], "body"),
    ],
)
def test_bad_reports_get_400_naming_the_field(client, body, field):
    register(client)
    response = client.post("/api/v1/models/m/report", json=body)
    assert response.status_code == 400
    assert response.get_json()["error"].startswith(f"{field}: ")


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        ('{"group_id": 0, "train_iter": 1, "iterations": 1, "seconds": NaN}', "NaN"),
        ('{"group_id": 0, "train_iter": 1, "iterations": 1, "seconds": Infinity}', "Infinity"),
        ('{"group_id": 0, "train_iter": 1, "iterations": 1, "seconds": -Infinity}', "Infinity"),
        ('{"group_id": 0, "train_iter": 1, "iterations": 1, "seconds": 1e400}', "seconds"),
        ('{"group_id": 0, "train_iter": 1, "iterations": 1, "seconds": 1', "not valid JSON"),
        ('{"group_id": ' + "9" * 5000 + "}", "not valid JSON"),
        ("[" * 100_000 + "]" * 100_000, "body"),
        ("", "not valid JSON"),
    ],
)
def test_non_json_numbers_and_broken_bodies_get_400(client, raw, fragment):
    register(client)
    response = client.post("/api/v1/models/m/report", data=raw, content_type="application/json")
    assert response.status_code == 400
    assert fragment in response.get_json()["error"]


def test_non_utf8_body_gets_400(client):
    register(client)
    response = client.post("/api/v1/models/m/report", data=b"\xff\xfe{")
    assert response.status_code == 400
    assert "UTF-8" in response.get_json()["error"]


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"world_size": 0}, "world_size"),
        ({"world_size": 6}, "world_size"),  # not nnodes x local_world_size
        ({"gradient_bytes": -1}, "gradient_bytes"),
        ({"gradient_bytes": 2**49}, "gradient_bytes"),
        ({"nnodes": 2.0}, "nnodes"),
        ({"fixed": [1]}, "fixed"),
        ({"fixed": {"bucket_size_2p": "big"}}, "fixed"),
        ({"fixed": {"colour": 1}}, "fixed"),
        ({"extra": 1}, "extra"),
    ],
)
def test_bad_registrations_get_400_naming_the_field(client, overrides, field):
    response = client.post("/api/v1/models/m/register", json={**REGISTRATION, **overrides})
    assert response.status_code == 400
    assert response.get_json()["error"].startswith(f"{field}: ")
    assert client.get("/api/v1/status").get_json() == {"models": {}}


def test_registration_fixed_knobs_are_merged_over_the_job_wide_ones():
    job_wide = FixedKnobs(is_hierarchical_reduce=True)
    client = make_client(TuningConfig(warmup_time=0, seed=1, fixed=job_wide))
    reply = register(client, fixed={"bucket_size_2p": 20})
    assert reply["group"]["hyperparameters"] == {
        "bucket_size_2p": 20,
        "is_hierarchical_reduce": True,
    }


def test_a_pinned_bucket_below_the_search_floor_is_kept_and_one_beyond_the_limit_is_400(client):
    # The 2**16 floor bounds what the tuner tries; a pin is the user's, as torch DDP's
    # bucket_cap_mb is, and the worker runs it as given, so the service agrees with it.
    reply = register(client, fixed={"bucket_size_2p": 10})
    assert reply["group"]["hyperparameters"]["bucket_size_2p"] == 10
    response = client.post(
        "/api/v1/models/n/register", json={**REGISTRATION, "fixed": {"bucket_size_2p": 49}}
    )
    assert response.status_code == 400
    assert response.get_json()["error"] == "fixed: bucket_size_2p must be in [0, 48], got 49"


def test_reregistration_resumes_and_other_facts_start_afresh(client):
    # test_tuning_reregistration.py has the cases; this is the REST round trip.
    register(client)
    for step in range(3):
        report(client, train_iter=step)
    again = register(client)
    assert again["group"]["id"] == 1
    afresh = register(client, gradient_bytes=2**20)
    assert afresh["group"]["id"] == 2 and afresh["state"] == "sampling"
    status = client.get("/api/v1/status").get_json()["models"]["m"]
    assert status["registration"]["gradient_bytes"] == 2**20
    assert [e["samples"] for e in status["earlier"]] == [1]


def test_the_number_of_models_is_bounded():
    client = make_client(TuningConfig(max_models=2))
    register(client, "a")
    register(client, "b")
    response = client.post("/api/v1/models/c/register", json=REGISTRATION)
    assert response.status_code == 409
    assert "at most 2 models" in response.get_json()["error"]
    assert register(client, "a")["group"]["id"] == 0  # known models still re-register
    one = make_client(TuningConfig(max_models=1))
    register(one, "a")
    error = one.post("/api/v1/models/b/register", json=REGISTRATION).get_json()["error"]
    assert error.startswith("this service tunes at most 1 model (a model registered")


def test_wrong_method_and_unknown_route_are_json(client):
    response = client.get("/api/v1/models/m/report")
    assert response.status_code == 405
    assert "POST" in response.headers["Allow"]
    # werkzeug's words named neither the method allowed nor where the routes are.
    assert response.get_json() == {
        "error": "Method Not Allowed: GET /api/v1/models/m/report; it takes POST"
    }
    response = client.get("/api/v2/status")
    assert response.status_code == 404
    assert response.get_json() == {
        "error": "Not Found: no route /api/v2/status; the routes are in GET /api/v1/openapi.json"
    }
    response = client.get("/dashboard/nothing.js")  # a 404 with words of its own keeps them
    assert "the dashboard has no file 'nothing.js'" in response.get_json()["error"]


def test_a_doubled_slash_is_a_json_404_not_a_redirect(client):
    register(client, "m")
    for path in ("/api/v1/models/m//report", "/api/v1/models//m/report"):
        response = client.post(path, json={"group_id": 0})
        assert response.status_code == 404, path
        assert "error" in response.get_json()


def test_bodies_over_one_mebibyte_get_413(client):
    register(client)
    body = json.dumps({"group_id": 0, "pad": "x" * MAX_BODY_BYTES})
    response = client.post("/api/v1/models/m/report", data=body, content_type="application/json")
    assert response.status_code == 413
    # It said werkzeug's "The data value transmitted exceeds the capacity limit.", no limit.
    assert response.get_json() == {
        "error": "body: over 1048576 bytes (1 MiB), the most a request may carry"
    }


def test_samples_switching_unit_is_a_400(client):
    register(client)
    report(client)  # discarded
    assert report(client, samples=64).status_code == 200
    response = report(client)
    assert response.status_code == 400
    assert response.get_json()["error"].startswith("samples: ")


class TestToken:
    TOKEN = "s3cret-token"

    @pytest.fixture
    def client(self):
        return make_client(token=self.TOKEN)

    def auth(self, token=TOKEN):
        return {"Authorization": f"Bearer {token}"}

    def test_health_needs_no_token(self, client):
        assert client.get("/api/v1/health").status_code == 200

    @pytest.mark.parametrize(
        "headers", [{}, {"Authorization": "Bearer nope"}, {"Authorization": TOKEN}]
    )
    def test_everything_else_needs_it_and_nothing_changes(self, client, headers):
        response = client.post("/api/v1/models/m/register", json=REGISTRATION, headers=headers)
        assert response.status_code == 401
        assert response.headers["WWW-Authenticate"].startswith("Bearer")
        assert self.TOKEN not in response.get_data(as_text=True)
        for path in ("/api/v1/status", "/api/v1/openapi.json", "/api/v1/models/m/log", "/nowhere"):
            assert client.get(path, headers=headers).status_code == 401
        assert client.get("/api/v1/status", headers=self.auth()).get_json() == {"models": {}}

    @pytest.mark.parametrize("header", [f"bearer {TOKEN}", f"BEARER {TOKEN}", f"Bearer   {TOKEN}"])
    def test_the_scheme_is_case_insensitive_as_rfc_7235_says(self, client, header):
        """`bearer <token>` (curl users, some proxies) was refused with 401."""
        response = client.get("/api/v1/status", headers={"Authorization": header})
        assert response.status_code == 200
        for wrong in (f"Basic {self.TOKEN}", f"Bearer {self.TOKEN} ", f"Bearer{self.TOKEN}"):
            assert client.get("/api/v1/status", headers={"Authorization": wrong}).status_code == 401

    def test_the_right_token_is_served(self, client):
        response = client.post("/api/v1/models/m/register", json=REGISTRATION, headers=self.auth())
        assert response.status_code == 200
        assert (
            client.get("/api/v1/models/m/hyperparameters", headers=self.auth()).status_code == 200
        )
