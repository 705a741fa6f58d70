"""The REST API v1 as a Flask application (docs/tuning_service.md, docs/architecture.md).

Every error is JSON, ``{"error": "..."}``, with a 4xx status for anything the client got wrong:
400 for a malformed body or field (the message names the field), 401 without the bearer token
(when the service has one), 404 for an unknown model or route, 405 for a wrong method, 409 for
a report on a group that is not current (its body also carries the current group) or a
conflicting registration, 413 for a body over 1 MiB. A 500 only ever means a bug in the service.
"""

from __future__ import annotations

import hmac
import json
import logging
from typing import Any, NoReturn

from flask import Flask, Response, jsonify, request
from werkzeug.exceptions import HTTPException

import distune
from distune.tuning_service import dashboard
from distune.tuning_service.messages import Registration, Report, RequestError
from distune.tuning_service.openapi import openapi_document
from distune.tuning_service.service import RegistrationError, TuningService, UnknownModelError
from distune.tuning_service.session import StaleGroupError

logger = logging.getLogger(__name__)

#: Request bodies larger than this get 413.
MAX_BODY_BYTES = 1024 * 1024
#: Routes that answer without the bearer token: health, and the dashboard's page and files
#: (code, no data; the page sends the token with each API call it makes).
PUBLIC_ENDPOINTS = frozenset({"health"}) | dashboard.ENDPOINTS


def _reject_constant(name: str) -> NoReturn:
    # Python's json accepts NaN and Infinity, which are not JSON; no field may hold them.
    raise RequestError("body", f"{name} is not a valid JSON number")


def _json_body() -> Any:
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


def _error(status: int, message: str, **extra: Any) -> tuple[Response, int]:
    return jsonify({"error": message, **extra}), status


def create_app(service: TuningService, token: str | None = None) -> Flask:
    """The WSGI application serving ``service``; with ``token``, every route but health needs
    ``Authorization: Bearer <token>``."""
    app = Flask("distune.tuning_service", static_folder=None)
    # A doubled slash (a model named "m/") is a 404, not an HTML redirect to another model's URL.
    app.url_map.merge_slashes = False
    app.config["MAX_CONTENT_LENGTH"] = MAX_BODY_BYTES
    app.json.sort_keys = False  # keep the documented field order
    expected = None if token is None else f"Bearer {token}".encode()

    @app.before_request
    def authenticate() -> tuple[Response, int] | None:
        if expected is None or request.endpoint in PUBLIC_ENDPOINTS:
            return None
        given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
        if hmac.compare_digest(given, expected):
            return None
        response, status = _error(401, "a valid 'Authorization: Bearer <token>' header is needed")
        response.headers["WWW-Authenticate"] = 'Bearer realm="distune"'
        return response, status

    @app.get("/api/v1/health", endpoint="health")
    def health() -> Response:
        return jsonify({"status": "ok", "version": distune.__version__})

    @app.post("/api/v1/models/<name>/register")
    def register(name: str) -> Response:
        registration = Registration.from_json(_json_body())
        return jsonify(service.register(name, registration).to_dict())

    @app.post("/api/v1/models/<name>/report")
    def report(name: str) -> Response:
        body = Report.from_json(_json_body())
        return jsonify(service.report(name, body).to_dict())

    @app.get("/api/v1/models/<name>/hyperparameters")
    def hyperparameters(name: str) -> Response:
        return jsonify(service.hyperparameters(name).to_dict())

    @app.get("/api/v1/models/<name>/log")
    def log(name: str) -> Response:
        return Response(service.log_csv(name), mimetype="text/csv")

    @app.get("/api/v1/status")
    def status() -> Response:
        return jsonify(service.status())

    @app.get("/api/v1/openapi.json")
    def openapi() -> Response:
        return jsonify(openapi_document(distune.__version__))

    dashboard.add_dashboard(app)

    @app.errorhandler(RequestError)
    def bad_request(error: RequestError) -> tuple[Response, int]:
        return _error(400, str(error))

    @app.errorhandler(UnknownModelError)
    def unknown_model(error: UnknownModelError) -> tuple[Response, int]:
        return _error(404, str(error.args[0]))

    @app.errorhandler(StaleGroupError)
    def stale_group(error: StaleGroupError) -> tuple[Response, int]:
        return _error(409, str(error), **error.reply.to_dict())

    @app.errorhandler(RegistrationError)
    def conflict(error: RegistrationError) -> tuple[Response, int]:
        return _error(409, str(error))

    @app.errorhandler(HTTPException)
    def http_error(error: HTTPException) -> Response:
        # Keep werkzeug's status and headers (e.g. Allow on a 405), but speak JSON.
        response = error.get_response()
        response.data = json.dumps({"error": f"{error.name}: {error.description}"})
        response.content_type = "application/json"
        return response

    @app.errorhandler(Exception)
    def internal_error(error: Exception) -> tuple[Response, int]:
        logger.exception("internal error serving %s %s", request.method, request.path)
        return _error(500, "internal error in the tuning service")

    return app
