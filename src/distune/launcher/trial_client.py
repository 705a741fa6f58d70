"""A launcher's calls to the tuning service's trial endpoints (level 2; docs/level2.md).

Every node's launcher uses one: node 0's publishes, records and finishes trials, every node's
reads the current trial and reports its own outcome, any node's may stop the trials. A failure
to reach the service is a :class:`~distune.errors.ServiceError` (a
:class:`NothingListeningError` where its host refused the connection); a refusal (4xx) is a
:class:`TrialRefusedError` carrying the service's own message.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import requests

from distune.errors import DistuneError, ServiceError
from distune.service_auth import bearer_headers, direct_session

#: Seconds to wait for one answer; the service answers trial calls in microseconds.
DEFAULT_TIMEOUT = 5.0


class NothingListeningError(ServiceError):
    """The service's host refused the connection: it is up, but nothing listens on that port
    (node 0's service not started yet, or a URL that is not node 0's service)."""


def _refused(error: BaseException) -> bool:
    """Whether ``error`` (requests' wrapping of urllib3's of the socket's) is a refused
    connection; the chain is followed through causes, contexts and urllib3's ``reason``."""
    seen: set[int] = set()
    pending: list[object] = [error]
    while pending:
        cause = pending.pop()
        if not isinstance(cause, BaseException) or id(cause) in seen:
            continue
        if isinstance(cause, ConnectionRefusedError):
            return True
        seen.add(id(cause))
        pending.extend([cause.__cause__, cause.__context__, getattr(cause, "reason", None)])
        pending.extend(cause.args)
    return False


class TrialRefusedError(DistuneError):
    """The service refused a trial request (a 4xx); ``status`` is the HTTP status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


@dataclass(frozen=True)
class TrialClient:
    """The trial endpoints of the service at ``url``."""

    url: str
    token: str | None = field(default=None, repr=False)
    timeout: float = DEFAULT_TIMEOUT

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        try:
            with direct_session() as session:
                response = session.request(
                    method, f"{self.url}/api/v1/trials{path}", json=body,
                    headers=bearer_headers(self.token),
                    timeout=self.timeout,
                )  # fmt: skip
        except requests.RequestException as error:
            if _refused(error):
                raise NothingListeningError(
                    f"cannot reach the tuning service at {self.url}: connection refused"
                ) from None
            raise ServiceError(
                f"cannot reach the tuning service at {self.url}: {type(error).__name__}"
            ) from None
        if 400 <= response.status_code < 500:
            try:
                message = str(response.json()["error"])
            except (ValueError, KeyError, TypeError):
                message = response.reason or "refused"
            raise TrialRefusedError(response.status_code, message)
        if not response.ok:
            raise ServiceError(
                f"the tuning service at {self.url} answered HTTP {response.status_code}"
            )
        return response.json()

    def overview(self) -> dict[str, Any]:
        """``GET /trials``: every recorded trial and the best."""
        return dict(self._call("GET", ""))

    def publish(self, spec: dict[str, Any]) -> dict[str, Any]:
        """``POST /trials``: open the next trial (node 0)."""
        return dict(self._call("POST", "", spec))

    def current(self, node_rank: int | None = None) -> dict[str, Any]:
        """``GET /trials/current``: the board's state and the latest trial; asked by
        ``node_rank``, the service notes that this node has seen the end."""
        query = "" if node_rank is None else f"?node_rank={node_rank}"
        return dict(self._call("GET", f"/current{query}"))

    def trial(self, trial: int) -> dict[str, Any]:
        """``GET /trials/<trial>``."""
        return dict(self._call("GET", f"/{trial}"))

    def report(self, trial: int, node_rank: int, report: dict[str, Any]) -> dict[str, Any]:
        """``POST /trials/<trial>/nodes/<node_rank>``: this node's outcome."""
        return dict(self._call("POST", f"/{trial}/nodes/{node_rank}", report))

    def record(self, trial: int, record: dict[str, Any]) -> dict[str, Any]:
        """``POST /trials/<trial>/record``: close the trial with its record (node 0)."""
        return dict(self._call("POST", f"/{trial}/record", record))

    def finish(self, finish: dict[str, Any]) -> dict[str, Any]:
        """``POST /trials/finish``: what every node trains with (node 0)."""
        return dict(self._call("POST", "/finish", finish))

    def stop(self, node_rank: int, reason: str) -> dict[str, Any]:
        """``POST /trials/stop``: stop the trials on every node."""
        return dict(self._call("POST", "/stop", {"node_rank": node_rank, "reason": reason}))
