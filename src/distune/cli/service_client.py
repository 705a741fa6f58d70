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
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import requests

from distune.cli import CommandError
from distune.worker_settings import SERVICE_TOKEN, SERVICE_URL

#: A file holding the service's token (first line), for when the environment should not.
SERVICE_TOKEN_FILE = "DISTUNE_SERVICE_TOKEN_FILE"
#: Seconds to wait for the service's answer.
DEFAULT_TIMEOUT = 5.0
#: A token file is read up to this many bytes; a token is far shorter.
_TOKEN_FILE_LIMIT = 4096


class ServiceError(CommandError):
    """The service cannot be reached or asked; the message says which and why."""


def read_token_file(path: str | os.PathLike[str]) -> str:
    """The token in the first line of ``path``, a regular file no group or other user may read."""
    path = Path(path)
    try:
        info = path.stat()
        if not stat.S_ISREG(info.st_mode):
            raise ServiceError(f"the token file {path} is not a regular file")
        if info.st_mode & (stat.S_IRGRP | stat.S_IROTH):
            raise ServiceError(
                f"the token file {path} is readable by other users "
                f"(mode {stat.S_IMODE(info.st_mode):04o}); make it private: chmod 600 {path}"
            )
        with path.open("rb") as file:
            data = file.read(_TOKEN_FILE_LIMIT)
    except OSError as error:
        raise ServiceError(f"cannot read the token file {path}: {error.strerror}") from None
    lines = data.decode("utf-8", "replace").splitlines()
    token = lines[0].strip() if lines else ""
    if not token:
        raise ServiceError(f"the token file {path} is empty")
    return token


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
        if not token:
            if token_file:
                token = read_token_file(token_file)
            elif environ.get(SERVICE_TOKEN):
                token = environ[SERVICE_TOKEN]
            elif environ.get(SERVICE_TOKEN_FILE):
                token = read_token_file(environ[SERVICE_TOKEN_FILE])
        return cls(_check_url(url), token or None, timeout)

    def get(self, path: str) -> requests.Response:
        """GET ``path`` (e.g. ``/api/v1/status``); a 2xx answer, or ServiceError."""
        headers = {} if self.token is None else {"Authorization": f"Bearer {self.token}"}
        try:
            response = requests.get(self.url + path, headers=headers, timeout=self.timeout)
        except requests.RequestException as error:
            raise ServiceError(
                f"cannot reach the tuning service at {self.url}: {_reason(error)}"
            ) from None
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


def _error_message(response: requests.Response) -> str:
    try:
        message = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        message = response.reason or "no explanation"
    return " ".join(str(message).split())[:200]
