"""The REST API v1 routes, as one Flask blueprint under ``/api/v1``.

Each route reads its JSON body through :func:`json_body`, parses it into a message
(``messages.py``) and asks the :class:`~distune.tuning_service.service.TuningService` that
``create_app`` put in ``app.extensions``. Errors are raised, never answered here: the
application's handlers (``app.py``) turn them into ``{"error": ...}`` with a 4xx status.
docs/tuning_service.md documents the endpoints; ``openapi.py`` describes them.
"""

from __future__ import annotations

import json
import re
from typing import Any, NoReturn, cast

from flask import Blueprint, Response, current_app, jsonify, request

import distune
from distune.tuning_service.messages import Registration, Report, RequestError
from distune.tuning_service.openapi import openapi_document
from distune.tuning_service.service import TuningService
from distune.tuning_service.trial_messages import (
    NodeReport,
    TrialRecord,
    TrialsFinish,
    TrialSpec,
    TrialsStop,
)

#: The key of the application's TuningService in ``app.extensions``.
EXTENSION = "distune"
#: Endpoints that answer without the bearer token.
PUBLIC_ENDPOINTS = frozenset({"api.health"})

blueprint = Blueprint("api", __name__, url_prefix="/api/v1")


def current_service() -> TuningService:
    """The TuningService of the application handling this request."""
    return cast(TuningService, current_app.extensions[EXTENSION])


def _reject_constant(name: str) -> NoReturn:
    # Python's json accepts NaN and Infinity, which are not JSON; no field may hold them.
    raise RequestError("body", f"{name} is not a valid JSON number")


def json_body() -> Any:
    """The request's body as JSON; RequestError (a 400) when it is not valid JSON."""
    raw = request.get_data(cache=False)  # raises 413 past MAX_CONTENT_LENGTH
    try:
        return json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except UnicodeDecodeError:
        raise RequestError("body", "must be UTF-8 encoded JSON") from None
    except RecursionError:
        raise RequestError("body", "is nested too deeply") from None
    except ValueError as error:  # JSONDecodeError, and integers too long to convert
        if isinstance(error, RequestError):
            raise
        raise RequestError("body", f"is not valid JSON ({error})") from None


@blueprint.get("/health")
def health() -> Response:
    """Liveness and version; needs no token."""
    return jsonify({"status": "ok", "version": distune.__version__})


@blueprint.post("/models/<name>/register")
def register(name: str) -> Response:
    """Register a model (or re-register it after a restart); answers its current group."""
    registration = Registration.from_json(json_body())
    return jsonify(current_service().register(name, registration).to_dict())


@blueprint.post("/models/<name>/report")
def report(name: str) -> Response:
    """Take one measured window; answers the group to run next."""
    body = Report.from_json(json_body())
    return jsonify(current_service().report(name, body).to_dict())


@blueprint.get("/models/<name>/hyperparameters")
def hyperparameters(name: str) -> Response:
    """The model's current group and state."""
    return jsonify(current_service().hyperparameters(name).to_dict())


@blueprint.get("/models/<name>/log")
def log(name: str) -> Response:
    """The model's CSV log rows."""
    return Response(current_service().log_csv(name), mimetype="text/csv")


@blueprint.get("/status")
def status() -> Response:
    """Every model's state, samples, current and best group."""
    return jsonify(current_service().status())


@blueprint.get("/trials")
def trials() -> Response:
    """Level 2: every recorded trial, the running one, the best, and the board's state."""
    return jsonify(current_service().trials.overview())


@blueprint.post("/trials")
def publish_trial() -> Response:
    """Level 2, node 0: open the next trial for every node to run."""
    return jsonify(current_service().trials.publish(TrialSpec.from_json(json_body())))


@blueprint.get("/trials/current")
def current_trial() -> Response:
    """Level 2, every node: the latest trial, and the finish or stop once there is one;
    ``?node_rank=i`` notes that node i has seen the end."""
    unknown = sorted(set(request.args) - {"node_rank"})
    if unknown:
        raise RequestError(
            repr(unknown[0]), "unknown query parameter; the one allowed is node_rank"
        )
    node_rank = request.args.get("node_rank")
    # ASCII digits only: str.isdigit() also takes "²", which int() refuses.
    if node_rank is not None and not re.fullmatch(r"[0-9]{1,6}", node_rank):
        raise RequestError("node_rank", f"must be a node rank (0, 1, ...), got {node_rank[:20]!r}")
    ranked = None if node_rank is None else int(node_rank)
    return jsonify(current_service().trials.current(ranked))


@blueprint.post("/trials/finish")
def finish_trials() -> Response:
    """Level 2, node 0: the search is over; what every node trains with."""
    return jsonify(current_service().trials.finish(TrialsFinish.from_json(json_body())))


@blueprint.post("/trials/stop")
def stop_trials() -> Response:
    """Level 2, any node: stop the trials on every node (a signal)."""
    return jsonify(current_service().trials.stop(TrialsStop.from_json(json_body())))


@blueprint.get("/trials/<int:trial>")
def trial(trial: int) -> Response:
    """Level 2: one trial's node reports, combined outcome and record."""
    return jsonify(current_service().trials.trial(trial))


@blueprint.post("/trials/<int:trial>/nodes/<int:node_rank>")
def report_trial(trial: int, node_rank: int) -> Response:
    """Level 2, every node: how the trial ended on this node."""
    body = NodeReport.from_json(json_body())
    return jsonify(current_service().trials.report(trial, node_rank, body))


@blueprint.post("/trials/<int:trial>/record")
def record_trial(trial: int) -> Response:
    """Level 2, node 0: close the trial with its trials.jsonl record."""
    body = TrialRecord.from_json(json_body(), trial)
    return jsonify(current_service().trials.record(trial, body))


@blueprint.get("/openapi.json")
def openapi() -> Response:
    """The OpenAPI 3 document of this API."""
    return jsonify(openapi_document(distune.__version__))
