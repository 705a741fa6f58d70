"""The tuning service as the ``distune`` commands reach it: its URL, its token, and reads.

The URL and token come from the command line or, when not given there, from the environment the
launcher documents: ``DISTUNE_SERVICE_URL``, ``DISTUNE_SERVICE_TOKEN``, or
``DISTUNE_SERVICE_TOKEN_FILE`` (a file holding the token, which no group or other user may
read). Every failure becomes a :class:`ServiceError` whose message fits on one line and never
contains the token.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import requests

from distune.errors import ServiceError
from distune.service_auth import (
    SERVICE_TOKEN_FILE,
    TokenError,
    bearer_headers,
    direct_session,
    read_token_file,
    token_from_environment,
)
from distune.worker_settings import SERVICE_TOKEN, SERVICE_URL

#: Seconds to wait for the service's answer.
DEFAULT_TIMEOUT = 5.0


def _check_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.query or parts.fragment:
        raise ServiceError(
            f"the service URL must look like http://HOST:PORT (as {SERVICE_URL} does), got {url!r}"
        )
    return url.rstrip("/")


def _reason(error: requests.RequestException) -> str:
    # requests wraps the socket error in three layers of text; the errno's words are the news.
    found = re.search(r"\[Errno -?\d+\] ([^'\")]+)", str(error))
    if found:
        return found.group(1).strip().lower()
    if isinstance(error, requests.Timeout):
        return "no answer in time"
    return type(error).__name__


@dataclass(frozen=True)
class ServiceConnection:
    """Where the service is and how to authenticate; :meth:`status` asks it."""

    url: str
    token: str | None = field(default=None, repr=False)
    timeout: float = DEFAULT_TIMEOUT

    @classmethod
    def resolve(
        cls,
        url: str | None = None,
        token: str | None = None,
        token_file: str | None = None,
        environ: Mapping[str, str] = os.environ,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> ServiceConnection:
        """The connection the options describe; what they leave out comes from ``environ``.

        The token is, in order: ``token``, ``token_file``, ``DISTUNE_SERVICE_TOKEN``,
        ``DISTUNE_SERVICE_TOKEN_FILE``; none means the service is asked without one.
        """
        url = url or environ.get(SERVICE_URL)
        if not url:
            raise ServiceError(f"which service? give --service URL or set {SERVICE_URL}")
        try:
            if not token and token_file:
                token = read_token_file(token_file)
            elif not token:
                token = token_from_environment(environ)
        except TokenError as error:
            raise ServiceError(str(error)) from None
        return cls(_check_url(url), token or None, timeout)

    def get(self, path: str) -> requests.Response:
        """GET ``path`` (e.g. ``/api/v1/status``); a 2xx answer, or ServiceError."""
        return self._checked(self._request(path), path)

    def _request(self, path: str) -> requests.Response:
        try:
            with direct_session() as session:
                return session.get(
                    self.url + path, headers=bearer_headers(self.token), timeout=self.timeout
                )
        except requests.RequestException as error:
            hint = ""
            if self.url.startswith("https:") and isinstance(
                error, requests.Timeout | requests.exceptions.SSLError
            ):
                # The service itself speaks plain HTTP: a TLS handshake sent to it is read as
                # the start of a request, which never ends, so the wait times out.
                hint = (
                    "; the service itself serves http:// (https only through a TLS proxy in "
                    "front of it)"
                )
            raise ServiceError(
                f"cannot reach the tuning service at {self.url}: {_reason(error)}{hint}"
            ) from None

    def _checked(self, response: requests.Response, path: str) -> requests.Response:
        if response.status_code == 401:
            if self.token is None:
                raise ServiceError(
                    f"the tuning service at {self.url} needs its token: give --token-file FILE, "
                    f"or set {SERVICE_TOKEN} or {SERVICE_TOKEN_FILE}"
                )
            raise ServiceError(f"the tuning service at {self.url} refused the token")
        if not response.ok:
            raise ServiceError(
                f"the tuning service at {self.url} answered {path} with HTTP "
                f"{response.status_code}: {_error_message(response)}"
            )
        return response

    def status(self) -> dict[str, Any]:
        """The ``/api/v1/status`` document: ``{"models": {name: {...}}}``."""
        response = self.get("/api/v1/status")
        try:
            status = response.json()
        except ValueError:
            status = None
        if not (isinstance(status, dict) and isinstance(status.get("models"), dict)):
            raise ServiceError(
                f"{self.url} did not answer /api/v1/status as a distune tuning service does"
            )
        return status

    def trials(self) -> dict[str, Any] | None:
        """The ``/api/v1/trials`` document (level 2's trials), or None from a service without
        trial endpoints (an older version)."""
        response = self._request("/api/v1/trials")
        if response.status_code == 404:
            return None
        try:
            trials = self._checked(response, "/api/v1/trials").json()
        except ValueError:
            trials = None
        if not (isinstance(trials, dict) and isinstance(trials.get("trials"), list)):
            raise ServiceError(
                f"{self.url} did not answer /api/v1/trials as a distune tuning service does"
            )
        return trials


def _error_message(response: requests.Response) -> str:
    try:
        message = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        message = response.reason or "no explanation"
    return " ".join(str(message).split())[:200]
