"""The ``DISTUNE_*`` environment: what the launcher tells every worker process.

The launcher writes these variables (:meth:`WorkerSettings.to_env`) and the worker runtime reads
them (:meth:`WorkerSettings.from_env`); keeping both directions in one place means the two sides
cannot drift apart. Like ``space``, this module imports neither torch nor the service.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import overload
from urllib.parse import urlsplit

from distune.checks import InvalidValue, positive_seconds
from distune.errors import DistuneError
from distune.space import DEFAULT_BUCKET_SIZE

AUTOTUNE_LEVEL = "DISTUNE_AUTOTUNE_LEVEL"
SERVICE_URL = "DISTUNE_SERVICE_URL"
SERVICE_TOKEN = "DISTUNE_SERVICE_TOKEN"
BUCKET_SIZE = "DISTUNE_BUCKET_SIZE"
HIERARCHICAL_REDUCE = "DISTUNE_HIERARCHICAL_REDUCE"
DEFAULT_BUCKET_SIZE_VAR = "DISTUNE_DEFAULT_BUCKET_SIZE"
SYNC_INTERVAL = "DISTUNE_SYNC_INTERVAL"

#: Every variable, with what it means, as the README lists them.
VARIABLES = {
    AUTOTUNE_LEVEL: "0: no tuning; 1: online tuning of the communication knobs (default 0)",
    SERVICE_URL: "base URL of the tuning service, e.g. http://10.0.0.1:29600",
    SERVICE_TOKEN: "bearer token for the tuning service (never printed)",
    BUCKET_SIZE: "fix the bucket size to this many bytes: it is not tuned",
    HIERARCHICAL_REDUCE: "fix hierarchical allreduce on (1) or off (0): it is not tuned",
    DEFAULT_BUCKET_SIZE_VAR: "bytes of the default group's bucket (default 25 MiB)",
    SYNC_INTERVAL: "seconds between the ranks' sync points while tuning (default 1.0)",
}


def variable_table(*more: Mapping[str, str]) -> str:
    """The README's table of the ``DISTUNE_*`` variables: :data:`VARIABLES`, then ``more``
    (level 2's, ``trial_settings.VARIABLES``)."""
    rows = ["| variable | meaning |", "|---|---|"]
    for variables in (VARIABLES, *more):
        rows += [f"| `{name}` | {meaning} |" for name, meaning in variables.items()]
    return "\n".join(rows) + "\n"


class SettingsError(DistuneError, ValueError):
    """A ``DISTUNE_*`` variable holds a value it may not; the message names it."""


@dataclass(frozen=True)
class WorkerSettings:
    """Job-wide settings every worker receives from the launcher."""

    autotune_level: int = 0
    service_url: str | None = None
    service_token: str | None = field(default=None, repr=False)  # never in a log line
    bucket_size: int | None = None
    hierarchical_reduce: bool | None = None
    default_bucket_size: int = DEFAULT_BUCKET_SIZE
    sync_interval: float = 1.0

    def __post_init__(self) -> None:
        if self.autotune_level not in (0, 1):
            raise SettingsError(f"{AUTOTUNE_LEVEL} must be 0 or 1, got {self.autotune_level!r}")
        for name, value in (
            (BUCKET_SIZE, self.bucket_size),
            (DEFAULT_BUCKET_SIZE_VAR, self.default_bucket_size),
        ):
            if value is not None and value <= 0:
                raise SettingsError(f"{name} must be a positive number of bytes, got {value}")
        try:
            positive_seconds(self.sync_interval)
        except InvalidValue as error:
            raise SettingsError(f"{SYNC_INTERVAL} {error}") from None
        if self.service_url is not None and not _is_http_url(self.service_url):
            # Refused here, at the wrapper's construction: the leader's requests would fail
            # as an outage, retried with back-off for the whole job, and nothing tuned.
            raise SettingsError(
                f"{SERVICE_URL} must be a URL like http://HOST:PORT, got {self.service_url!r}"
            )

    @property
    def tuning(self) -> bool:
        """Whether the job tunes itself: level 1 and a service to talk to."""
        return self.autotune_level >= 1 and self.service_url is not None

    def to_env(self) -> dict[str, str]:
        """The variables to add to a worker's environment (unset optional values are omitted)."""
        env = {
            AUTOTUNE_LEVEL: str(self.autotune_level),
            DEFAULT_BUCKET_SIZE_VAR: str(self.default_bucket_size),
            SYNC_INTERVAL: repr(self.sync_interval),
        }
        if self.service_url is not None:
            env[SERVICE_URL] = self.service_url
        if self.service_token is not None:
            env[SERVICE_TOKEN] = self.service_token
        if self.bucket_size is not None:
            env[BUCKET_SIZE] = str(self.bucket_size)
        if self.hierarchical_reduce is not None:
            env[HIERARCHICAL_REDUCE] = "1" if self.hierarchical_reduce else "0"
        return env

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> WorkerSettings:
        """Read the settings from ``environ`` (default: this process's environment)."""
        environ = os.environ if environ is None else environ
        defaults = cls()
        return cls(
            autotune_level=_parse_int(environ, AUTOTUNE_LEVEL, defaults.autotune_level),
            service_url=environ.get(SERVICE_URL) or None,
            service_token=environ.get(SERVICE_TOKEN) or None,
            bucket_size=_parse_int(environ, BUCKET_SIZE, None),
            hierarchical_reduce=_parse_bool(environ, HIERARCHICAL_REDUCE),
            default_bucket_size=_parse_int(
                environ, DEFAULT_BUCKET_SIZE_VAR, defaults.default_bucket_size
            ),
            sync_interval=_parse_float(environ, SYNC_INTERVAL, defaults.sync_interval),
        )


def _is_http_url(text: str) -> bool:
    try:
        parts = urlsplit(text)
        _ = parts.port  # raises for a port that is not a number
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname)


@overload
def _parse_int(environ: Mapping[str, str], name: str, default: int) -> int: ...
@overload
def _parse_int(environ: Mapping[str, str], name: str, default: None) -> int | None: ...
def _parse_int(environ: Mapping[str, str], name: str, default: int | None) -> int | None:
    text = environ.get(name, "").strip()
    if not text:
        return default
    try:
        return int(text)
    except ValueError:
        raise SettingsError(f"{name} must be an integer, got {text!r}") from None


def _parse_float(environ: Mapping[str, str], name: str, default: float) -> float:
    text = environ.get(name, "").strip()
    if not text:
        return default
    try:
        return float(text)
    except ValueError:
        raise SettingsError(f"{name} must be a number, got {text!r}") from None


def _parse_bool(environ: Mapping[str, str], name: str) -> bool | None:
    text = environ.get(name, "").strip().lower()
    if not text:
        return None
    if text in ("1", "true", "yes"):
        return True
    if text in ("0", "false", "no"):
        return False
    raise SettingsError(f"{name} must be 1 or 0 (true or false), got {text!r}")
