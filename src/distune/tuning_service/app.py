"""The tuning service's WSGI application: Flask, its blueprints, token check and error answers.

``create_app`` puts the :class:`~distune.tuning_service.service.TuningService` in
``app.extensions`` and registers one blueprint a module: the REST API v1 (``api.py``) and the
dashboard (``dashboard.py``). Every error is JSON, ``{"error": "..."}``, with a 4xx status for
anything the client got wrong: 400 for a malformed body or field (the message names the field),
401 without the bearer token (when the service has one), 404 for an unknown model, trial or
route, 405 for a wrong method, 409 for a report on a group that is not current (its body also
carries the current group) or of a replaced registration, a registration past the model limit
or a trial request out of turn, 413 for
a body over 1 MiB. A 500 only ever means a bug in the service. docs/tuning_service.md has the
details.
"""

from __future__ import annotations

import hmac
import json
import logging
from typing import Any

from flask import Flask, Response, current_app, jsonify, request
from werkzeug.exceptions import HTTPException, MethodNotAllowed, NotFound, RequestEntityTooLarge

from distune.tuning_service import api, dashboard
from distune.tuning_service.messages import RequestError
from distune.tuning_service.service import (
    RegistrationError,
    SupersededError,
    TuningService,
    UnknownModelError,
)
from distune.tuning_service.session import StaleGroupError
from distune.tuning_service.trial_board import TrialConflictError, UnknownTrialError

logger = logging.getLogger(__name__)

#: Request bodies larger than this get 413.
MAX_BODY_BYTES = 1024 * 1024
#: Routes that answer without the bearer token: health, and the dashboard's page and files
#: (code, no data; the page sends the token with each API call it makes).
PUBLIC_ENDPOINTS = api.PUBLIC_ENDPOINTS | dashboard.ENDPOINTS
#: The config key of the expected bearer token's bytes (None: no token).
_BEARER = "DISTUNE_BEARER"


def create_app(service: TuningService, token: str | None = None) -> Flask:
    """The WSGI application serving ``service``; with ``token``, every route but health and
    the dashboard's files needs ``Authorization: Bearer <token>``."""
    app = Flask("distune.tuning_service", static_folder=None)
    # A doubled slash (a model named "m/") is a 404, not an HTML redirect to another model's URL.
    app.url_map.merge_slashes = False
    app.config["MAX_CONTENT_LENGTH"] = MAX_BODY_BYTES
    app.config[_BEARER] = None if token is None else token.encode()
    app.json.sort_keys = False  # type: ignore[attr-defined]  # keep the documented field order
    app.extensions[api.EXTENSION] = service
    app.before_request(_authenticate)
    app.register_blueprint(api.blueprint)
    app.register_blueprint(dashboard.blueprint)
    for error, handler in _ERROR_HANDLERS:
        app.register_error_handler(error, handler)
    return app


def _error(status: int, message: str, **extra: Any) -> tuple[Response, int]:
    return jsonify({"error": message, **extra}), status


def _authenticate() -> tuple[Response, int] | None:
    expected = current_app.config[_BEARER]
    if expected is None or request.endpoint in PUBLIC_ENDPOINTS:
        return None
    # The scheme is case-insensitive and followed by one or more spaces (RFC 7235 2.1, RFC
    # 6750 2.1): `bearer <token>`, as some clients and proxies send it, is the same header.
    scheme, _, credentials = request.headers.get("Authorization", "").partition(" ")
    given = credentials.lstrip(" ").encode("utf-8", "surrogateescape")
    if scheme.lower() == "bearer" and hmac.compare_digest(given, expected):
        return None
    response, status = _error(401, "a valid 'Authorization: Bearer <token>' header is needed")
    response.headers["WWW-Authenticate"] = 'Bearer realm="distune"'
    return response, status


def _bad_request(error: RequestError) -> tuple[Response, int]:
    return _error(400, str(error))


def _unknown_model(error: UnknownModelError) -> tuple[Response, int]:
    return _error(404, str(error.args[0]))


def _stale_group(error: StaleGroupError) -> tuple[Response, int]:
    return _error(409, str(error), **error.reply.to_dict())


def _superseded(error: SupersededError) -> tuple[Response, int]:
    return _error(409, str(error), **error.to_dict())


def _conflict(error: RegistrationError) -> tuple[Response, int]:
    return _error(409, str(error))


def _unknown_trial(error: UnknownTrialError) -> tuple[Response, int]:
    return _error(404, str(error.args[0]))


def _trial_conflict(error: TrialConflictError) -> tuple[Response, int]:
    return _error(409, str(error))


def _too_large(error: RequestEntityTooLarge) -> tuple[Response, int]:
    # werkzeug's text names no limit: say what is allowed.
    return _error(413, f"body: over {MAX_BODY_BYTES} bytes (1 MiB), the most a request may carry")


def _http_error(error: HTTPException) -> Response:
    # Keep werkzeug's status and headers (e.g. Allow on a 405), but speak JSON, saying what is
    # allowed where werkzeug's own words do not.
    response = error.get_response()
    message = f"{error.name}: {error.description}"
    if isinstance(error, MethodNotAllowed) and error.valid_methods:
        allowed = ", ".join(m for m in sorted(error.valid_methods) if m not in ("HEAD", "OPTIONS"))
        message = f"{error.name}: {request.method} {request.path}; it takes {allowed}"
    elif isinstance(error, NotFound) and error.description == NotFound.description:
        message = (
            f"{error.name}: no route {request.path}; the routes are in GET /api/v1/openapi.json"
        )
    response.data = json.dumps({"error": message}).encode()
    response.content_type = "application/json"
    return response  # type: ignore[return-value]  # werkzeug's Response, which Flask serves


def _internal_error(error: Exception) -> tuple[Response, int]:
    logger.exception("internal error serving %s %s", request.method, request.path)
    return _error(500, "internal error in the tuning service")


_ERROR_HANDLERS: tuple[tuple[type[Exception], Any], ...] = (
    (RequestError, _bad_request),
    (UnknownModelError, _unknown_model),
    (StaleGroupError, _stale_group),
    (SupersededError, _superseded),
    (RegistrationError, _conflict),
    (UnknownTrialError, _unknown_trial),
    (TrialConflictError, _trial_conflict),
    (RequestEntityTooLarge, _too_large),
    (HTTPException, _http_error),
    (Exception, _internal_error),
)
