"""Fuzzing the REST API in process (WSGI, no sockets).

1. schemathesis generates requests from the service's own OpenAPI document, valid and invalid
   ones, for every operation: at least 1,000 of them. None may get a 5xx; every error is a
   JSON 4xx whose ``error`` says what is wrong; every answer matches the document.
2. A hypothesis state machine sends sequences of register/report/hyperparameters/status/log
   calls with random names, ids and bodies, and checks the service stays consistent.

Both are derandomized: the suite runs the same cases every time. To explore new ones, run
with ``--hypothesis-seed=<n>``.
"""

import json
import math
from collections import Counter
from urllib.parse import quote

import pytest
import schemathesis
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance

from distune.tuning_service.app import create_app
from distune.tuning_service.config import OptimizerSettings, TuningConfig
from distune.tuning_service.service import TuningService

TOKEN = "fuzz-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
MAX_MODELS = 12
CONFIG = TuningConfig(
    max_samples=5,
    sampling_confidence_time=0.5,
    min_windows=1,
    warmup_time=0.5,
    seed=11,
    max_models=MAX_MODELS,
    optimizer=OptimizerSettings(initial_points=2, stop_min_groups=2, stop_min_share=0.0),
)
ORDER = {"warmup": 0, "sampling": 1, "completed": 2}


def check_error_body(status: int, content_type: str, body: bytes) -> None:
    """A 4xx is JSON with a non-empty ``error`` string; a 5xx never happens."""
    assert status < 500, body
    if status >= 400:
        assert content_type.startswith("application/json"), (status, content_type, body)
        error = json.loads(body)["error"]
        assert isinstance(error, str) and len(error) > 10, body


@pytest.mark.parametrize(
    ("extra", "field"),
    [({}, "iterations"), ({"samples": 10**9}, "samples")],
)
def test_absurd_rates_are_refused_naming_the_field(extra, field):
    client = create_app(TuningService(CONFIG), token=TOKEN).test_client()
    registration = {"world_size": 1, "nnodes": 1, "local_world_size": 1, "gradient_bytes": 10}
    client.post("/api/v1/models/m/register", json=registration, headers=AUTH)
    # A billion and one iterations (or samples) in a second.
    body = {"group_id": 0, "train_iter": 1, "iterations": 10**9 + 1, "seconds": 1.0, **extra}
    if extra:
        body["iterations"], body["samples"] = 1, 10**9 + 1
    response = client.post("/api/v1/models/m/report", json=body, headers=AUTH)
    assert response.status_code == 400
    assert response.get_json()["error"].startswith(
        f"{field}: {field} / seconds must be at most 1e+09"
    )
    body["seconds"] = 2.0  # half a billion a second: accepted
    assert client.post("/api/v1/models/m/report", json=body, headers=AUTH).status_code == 200


#: A report's counts: JSON Schema's "integer" admits 4.0, which the service refuses as a count.
REPORT_COUNTS = ("group_id", "train_iter", "iterations", "samples")


def made_useful(case):
    """Make a valid case useful where the document cannot say what the service needs: a
    registration's world_size is nnodes x local_world_size (so generated registrations fill the
    service), and a report's counts are integers, not integral floats (so reports get scored)."""
    body = case.body
    if not isinstance(body, dict):
        return case
    if case.operation.path.endswith("/register"):
        counts = [body.get("nnodes"), body.get("local_world_size")]
        if all(isinstance(n, int) and not isinstance(n, bool) for n in counts):
            body["world_size"] = counts[0] * counts[1]
    if case.operation.path.endswith("/report"):
        for name in REPORT_COUNTS:
            if isinstance(body.get(name), float) and body[name].is_integer():
                body[name] = int(body[name])
    return case


def test_generated_requests_from_the_openapi_document():
    app = create_app(TuningService(CONFIG), token=TOKEN)
    schema = schemathesis.openapi.from_wsgi("/api/v1/openapi.json", app, headers=AUTH)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 7
    per_model = [op for op in operations if "{name}" in op.path]

    def generated(mode, strategy):
        # Valid cases are made more often useful; invalid ones are left as they are.
        if mode is GenerationMode.POSITIVE:
            strategy = strategy.map(made_useful)
        return strategy.map(lambda case: (mode, case))

    cases = st.one_of(
        # Every operation, names and bodies as the document allows (or not)...
        [
            generated(mode, operation.as_strategy(mode))
            for operation in operations
            for mode in GenerationMode
        ]
        # ...and the per-model ones on a few names, so that reports reach registered models.
        + [
            generated(
                mode,
                st.sampled_from(["m0", "m1", "m2"]).flatmap(
                    lambda name, op=operation, mode=mode: op.as_strategy(
                        mode, path_parameters={"name": name}
                    )
                ),
            )
            for operation in per_model
            for mode in GenerationMode
        ]
    )
    statuses: Counter[tuple[str, int]] = Counter()

    # "A schema-valid request is accepted" cannot hold: the document cannot express the
    # cross-field rules (world_size = nnodes x local_world_size, a report's unit, the model
    # limit), and JSON Schema's "integer" admits 4.0, which the service refuses as a count.
    # Every other check of schemathesis runs, invalid requests refused included.
    client = app.test_client()
    # The few names the per-model cases use are registered first, so that valid reports meet
    # a model whatever order the generated cases come in (which varies with what else ran in
    # the process: in the whole suite no generated registration of these names came first).
    facts = {"world_size": 2, "nnodes": 1, "local_world_size": 2, "gradient_bytes": 2**20}
    for name in ("m0", "m1", "m2"):
        assert (
            client.post(f"/api/v1/models/{name}/register", json=facts, headers=AUTH).status_code
            == 200
        )

    @given(generated_case=cases, current=st.booleans())
    @settings(
        max_examples=1100,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def fuzz(generated_case, current):
        mode, case = generated_case
        is_report = case.operation.path.endswith("/report")
        if (
            mode is GenerationMode.POSITIVE
            and current
            and is_report
            and isinstance(case.body, dict)
        ):
            # Name the model's current group, so that reports also get past the 409.
            name = quote(str(case.path_parameters["name"]), safe="")
            asked = client.get(f"/api/v1/models/{name}/hyperparameters", headers=AUTH)
            if asked.status_code == 200:
                case.body["group_id"] = asked.get_json()["group"]["id"]
        response = case.call_and_validate(headers=AUTH, excluded_checks=[positive_data_acceptance])
        headers = {name.lower(): values for name, values in response.headers.items()}
        check_error_body(
            response.status_code, headers.get("content-type", [""])[0], response.content
        )
        statuses[(case.operation.label, response.status_code)] += 1

    fuzz()
    assert sum(statuses.values()) >= 1000
    # The run reached past validation: models were registered and reports scored.
    assert statuses[("POST /api/v1/models/{name}/register", 200)] > 0
    assert statuses[("POST /api/v1/models/{name}/report", 200)] > 0
    assert statuses[("POST /api/v1/models/{name}/report", 400)] > 0
    # Whatever the fuzz left behind, the service still counts its models right: it takes new
    # ones up to the limit and refuses the next. (How many names the fuzz registered varies
    # with the generated cases, so the limit is reached here, not assumed of the fuzz.) A name
    # registered again with other facts counts once per registration.
    models = client.get("/api/v1/status", headers=AUTH).get_json()["models"]
    registered = sum(1 + len(model["earlier"]) for model in models.values())
    assert 0 < registered <= MAX_MODELS
    facts = {"world_size": 1, "nnodes": 1, "local_world_size": 1, "gradient_bytes": 10}
    for extra in range(MAX_MODELS - registered + 1):
        answer = client.post(f"/api/v1/models/extra{extra}/register", json=facts, headers=AUTH)
        assert answer.status_code == (200 if registered + extra < MAX_MODELS else 409)
    assert "one too many" in answer.get_json()["error"]
    models = client.get("/api/v1/status", headers=AUTH).get_json()["models"]
    assert sum(1 + len(model["earlier"]) for model in models.values()) == MAX_MODELS


# Bodies a confused or hostile client might send, beside valid ones.
JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4)
    ),
    max_leaves=10,
)
POOL = ["a", "b", "m.0"]
NAMES = st.sampled_from([*POOL, "x-y_z"]) | st.text(max_size=70)
REGISTRATIONS = st.sampled_from(
    [
        {"world_size": 8, "nnodes": 2, "local_world_size": 4, "gradient_bytes": 2**22},
        {"world_size": 2, "nnodes": 1, "local_world_size": 2, "gradient_bytes": 2**18},
        {
            "world_size": 2,
            "nnodes": 1,
            "local_world_size": 2,
            "gradient_bytes": 2**18,
            "fixed": {"bucket_size_2p": 17},
        },
    ]
)
NUMBERS = (
    st.integers(-5, 2**60)
    | st.floats(allow_nan=False)
    | st.sampled_from([0, 1, 0.1, 1e-7, 1e7, 2**53 + 1, "1", True, None])
)
RAW_BODIES = st.sampled_from(
    [
        b"",
        b"{",
        b"NaN",
        b'{"seconds": NaN}',
        b'{"seconds": Infinity}',
        b"\xff\xfe",
        b"[]",
        b'{"a": 1e999}',
        b"9" * 5000,
        b"[" * 5000,
    ]
)


class ApiMachine(RuleBasedStateMachine):
    """Random calls to one service over its WSGI app; invariants over what it answers."""

    @initialize()
    def start(self):
        self.client = create_app(TuningService(CONFIG), token=TOKEN).test_client()
        self.seen: dict[str, dict] = {}  # the last status of each model, to compare with

    def call(self, method, path, **kwargs):
        response = self.client.open(path, method=method, headers=AUTH, **kwargs)
        check_error_body(response.status_code, response.content_type or "", response.data)
        return response

    @rule(name=st.sampled_from(POOL), body=REGISTRATIONS)
    def register_known(self, name, body):
        response = self.call("POST", f"/api/v1/models/{name}/register", json=body)
        # Other facts replace the session; 409: one registration more than max_models.
        assert response.status_code in (200, 409)

    @rule(name=NAMES, body=REGISTRATIONS | JSON_VALUES)
    def register(self, name, body):
        response = self.call("POST", f"/api/v1/models/{name}/register", json=body)
        if response.status_code == 200:
            assert response.get_json()["state"] in ORDER

    @rule(
        name=NAMES,
        current=st.booleans(),
        group_id=NUMBERS,
        iterations=NUMBERS,
        seconds=NUMBERS,
        extra=st.dictionaries(st.sampled_from(["samples", "train_iter", "bogus"]), NUMBERS),
    )
    def report(self, name, current, group_id, iterations, seconds, extra):
        if current and name in self.seen:
            group_id = self.seen[name]["current"]["id"]
        body = {
            "group_id": group_id,
            "train_iter": 1,
            "iterations": iterations,
            "seconds": seconds,
            **extra,
        }
        response = self.call("POST", f"/api/v1/models/{name}/report", json=body)
        if response.status_code == 409:  # a stale group: the answer names the current one
            assert {"group", "state", "completed"} <= set(response.get_json())
            if response.get_json()["state"] == "superseded":  # one of a replaced registration
                assert response.get_json()["completed"] is True

    @rule(
        name=st.sampled_from(POOL),
        seconds=st.sampled_from([0.05, 0.2, 1.0]),
        rate=st.floats(50.0, 150.0),
        windows=st.integers(1, 8),
    )
    def steady_reports(self, name, seconds, rate, windows):
        """Plausible windows of a registered model's current group, so sessions progress."""
        if name not in self.seen:
            return
        group_id = self.seen[name]["current"]["id"]
        for _ in range(windows):
            iterations = max(1, round(rate * seconds))
            body = {
                "group_id": group_id,
                "train_iter": 1,
                "iterations": iterations,
                "seconds": iterations / rate,
            }
            response = self.call("POST", f"/api/v1/models/{name}/report", json=body)
            assert response.status_code == 200, response.get_json()
            group_id = response.get_json()["group"]["id"]

    @rule(name=NAMES, path=st.sampled_from(["report", "register"]), raw=RAW_BODIES)
    def raw_body(self, name, path, raw):
        response = self.call(
            "POST", f"/api/v1/models/{name}/{path}", data=raw, content_type="application/json"
        )
        assert 400 <= response.status_code < 500

    @rule(name=NAMES)
    def hyperparameters(self, name):
        response = self.call("GET", f"/api/v1/models/{name}/hyperparameters")
        if name in self.seen:
            assert response.status_code == 200

    @rule(name=NAMES)
    def log(self, name):
        response = self.call("GET", f"/api/v1/models/{name}/log")
        if response.status_code == 200:
            rows = response.data.decode().splitlines()
            assert rows[0].startswith("bucket_size_2p,is_hierarchical_reduce,score,train_iter")

    @invariant()
    def consistent(self):
        if not hasattr(self, "client"):
            return
        models = self.call("GET", "/api/v1/status").get_json()["models"]
        assert sum(1 + len(model["earlier"]) for model in models.values()) <= MAX_MODELS
        assert set(self.seen) <= set(models)
        for name, now in models.items():
            assert now["samples"] <= now["max_samples"]
            asked = self.call("GET", f"/api/v1/models/{name}/hyperparameters").get_json()
            assert asked["group"] == now["current"] and asked["state"] == now["state"]
            before = self.seen.get(name)
            if before is not None:
                # Group ids grow across registrations with other facts too.
                assert now["current"]["id"] >= before["current"]["id"]
                assert len(now["earlier"]) >= len(before["earlier"])
            if before is not None and len(now["earlier"]) == len(before["earlier"]):
                # The same registration: its session only moves on.
                assert ORDER[now["state"]] >= ORDER[before["state"]]
                assert now["samples"] >= before["samples"]
                if before["state"] == "completed":
                    assert {**now, "earlier": []} == {**before, "earlier": []}
            event(f"reached {now['state']}")  # coverage: --hypothesis-show-statistics
            if now["best"] is not None:
                assert math.isfinite(now["best"]["score"]) and now["best"]["score"] > 0
            self.seen[name] = now


ApiMachine.TestCase.settings = settings(
    max_examples=30,
    stateful_step_count=40,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)
TestApiStateMachine = ApiMachine.TestCase
