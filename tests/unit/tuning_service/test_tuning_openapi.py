"""The OpenAPI document: valid, complete, and true to what the app answers."""

import re

import pytest
from openapi_schema_validator import OAS31Validator
from openapi_spec_validator import validate

from distune.tuning_service.app import create_app
from distune.tuning_service.config import TuningConfig
from distune.tuning_service.service import TuningService
from tests.support.models import MULTI_NODE_LARGE_REGISTRATION as REGISTRATION

AUTOMATIC_METHODS = {"HEAD", "OPTIONS"}


@pytest.fixture
def app():
    config = TuningConfig(max_samples=3, sampling_confidence_time=1.0, min_windows=1, seed=0)
    return create_app(TuningService(config))


@pytest.fixture
def document(app):
    response = app.test_client().get("/api/v1/openapi.json")
    assert response.status_code == 200
    return response.get_json()


def conforms(document, schema_name, instance):
    """Validate ``instance`` against a component schema, resolving its references."""
    schema = {"$ref": f"#/components/schemas/{schema_name}", "components": document["components"]}
    OAS31Validator(schema).validate(instance)


def test_the_document_is_valid_openapi(document):
    validate(document)
    assert document["openapi"].startswith("3.")


def test_every_route_the_app_serves_is_documented_with_its_methods(app, document):
    paths = document["paths"]
    served = 0
    for rule in app.url_map.iter_rules():
        path = re.sub(r"<(?:[^:>]+:)?([^>]+)>", r"{\1}", rule.rule)
        assert path in paths, f"{rule.rule} is not in the OpenAPI document"
        methods = {m.lower() for m in rule.methods - AUTOMATIC_METHODS}
        assert methods <= set(paths[path]), f"{rule.rule}: {methods} not all documented"
        served += 1
    documented = sum(len(operations) for operations in paths.values())
    assert served == documented == 17


def test_every_operation_documents_its_errors_and_bodies(document):
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            assert "200" in operation["responses"], (path, method)
            if method == "post":
                assert operation["requestBody"]["required"] is True
                assert "400" in operation["responses"] and "413" in operation["responses"]
            if "{name}" in path and not path.endswith("/register"):
                assert "404" in operation["responses"], (path, method)


def test_real_answers_conform_to_the_documented_schemas(app, document):
    client = app.test_client()
    conforms(document, "Health", client.get("/api/v1/health").get_json())
    conforms(document, "Registration", REGISTRATION)
    conforms(document, "Status", client.get("/api/v1/status").get_json())
    group = client.post("/api/v1/models/m/register", json=REGISTRATION).get_json()
    conforms(document, "Reply", group)
    report = {"group_id": 0, "train_iter": 1, "iterations": 5, "seconds": 0.5, "samples": 40}
    conforms(document, "Report", report)
    for step in range(20):
        reply = client.post("/api/v1/models/m/report", json=report | {"train_iter": step})
        conforms(document, "Reply", reply.get_json())
        if reply.get_json()["completed"]:
            break
    stale = client.post("/api/v1/models/m/report", json=report | {"group_id": 10**6})
    assert stale.status_code == 409
    conforms(document, "StaleGroup", stale.get_json())
    conforms(document, "Status", client.get("/api/v1/status").get_json())
    conforms(document, "Reply", client.get("/api/v1/models/m/hyperparameters").get_json())
    for response in (
        client.get("/api/v1/models/nobody/hyperparameters"),
        client.post("/api/v1/models/m/report", json={}),
    ):
        conforms(document, "Error", response.get_json())


def test_the_schemas_refuse_what_the_app_refuses(document):
    bad = {"group_id": 0, "train_iter": 1, "iterations": 0, "seconds": 1.0}
    with pytest.raises(Exception, match="minimum"):
        conforms(document, "Report", bad)
    with pytest.raises(Exception, match="Additional properties"):
        conforms(document, "Registration", REGISTRATION | {"colour": "blue"})
