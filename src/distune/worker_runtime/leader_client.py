"""The leader's conversation with the tuning service, in a background thread.

Only rank 0 talks HTTP, and only from this thread: the training thread hands it finished windows
(:meth:`LeaderClient.report`, which never blocks) and reads the latest answer
(:meth:`LeaderClient.latest`, a lock held for a copy). So a slow, dead or confused service never
slows a training step; training keeps the group it has.

The thread registers the model (again whenever the service no longer knows it, e.g. after a
restart), then posts each window. Every answer carries the service's current group, which becomes
the latest answer. A 409 answer to a report means the report's group is no longer current: normal
after a switch, and its body carries the current group. Anything else that is not a valid answer
(no connection, a timeout, a 5xx, a 401, a body that is not the expected JSON) is a failure: the
window is dropped, one warning is logged for the outage (not one per window), and the thread
retries with exponential back-off until the service answers again.

A 409 answer to a registration is a refusal, not a failure: the service tunes as many models as
it may. Retrying cannot help, so the service's message is logged once as a warning, the thread
ends, and :attr:`LeaderClient.refused` tells the sync points to stop tuning this model.

A registration with other facts than the name's session (the model wrapped again after
unfreezing layers, the job restarted on another number of nodes) is tuned afresh by the service
in a new session. A report of the registration it replaced is answered 409 with state
``superseded``: that model is still training, so another one took its name; it is not tuned
any more, and says so once, unless it is this process's own older wrapper being closed. So
that the service never mistakes that older wrapper for a second live model, a leader started
``after`` it registers only once the older one's thread has ended.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import requests

from distune.errors import DistuneError, ServiceError
from distune.service_auth import bearer_headers, direct_session
from distune.space import (
    MODEL_NAME_RULE,
    FixedKnobs,
    HyperparameterError,
    Hyperparameters,
    ModelFacts,
    SearchSpace,
    is_valid_model_name,
)

logger = logging.getLogger(__name__)

#: Finished windows waiting to be posted; older ones are dropped when the service lags.
QUEUE_LIMIT = 16
#: The state of a 409 to a report of a registration that one with other facts replaced.
SUPERSEDED = "superseded"


def check_model_name(name: object) -> str:
    """Return ``name`` if the service accepts it as a model name, else raise ValueError."""
    if not is_valid_model_name(name):
        raise ValueError(f"model name must be {MODEL_NAME_RULE}, got {name!r}")
    return name


@dataclass(frozen=True)
class ServiceAnswer:
    """The service's current group for the model, and whether tuning is over."""

    group_id: int
    hyperparameters: Hyperparameters
    state: str
    completed: bool


@dataclass(frozen=True)
class WindowReport:
    """One window: ``iterations`` iterations under group ``group_id``, ending at iteration
    ``train_iter``, that took the slowest rank ``seconds``."""

    group_id: int
    train_iter: int
    iterations: int
    seconds: float

    def to_json(self) -> dict[str, Any]:
        """The body of ``POST /api/v1/models/<name>/report``."""
        return {
            "group_id": self.group_id,
            "train_iter": self.train_iter,
            "iterations": self.iterations,
            "seconds": self.seconds,
        }


@dataclass(frozen=True)
class ClientConfig:
    """Timeouts and back-off of the leader's HTTP conversation."""

    connect_timeout: float = 2.0
    read_timeout: float = 5.0
    initial_backoff: float = 0.5
    max_backoff: float = 30.0


class LeaderClient:
    """Rank 0's link to the tuning service for one model.

    ``space`` is the model's search space, computed exactly as the service computes it: an
    answer outside it is treated as garbage. Call :meth:`start` once; :meth:`close` ends the
    thread (it is a daemon, so a hung request never holds the process at exit).
    """

    def __init__(
        self,
        url: str,
        token: str | None,
        name: str,
        facts: ModelFacts,
        fixed: FixedKnobs,
        space: SearchSpace,
        config: ClientConfig | None = None,
    ) -> None:
        self._base = f"{url.rstrip('/')}/api/v1/models/{quote(check_model_name(name), safe='')}"
        self._url = url
        self._name = name
        self._headers = bearer_headers(token)
        self._registration: dict[str, Any] = {
            "world_size": facts.world_size,
            "nnodes": facts.nnodes,
            "local_world_size": facts.local_world_size,
            "gradient_bytes": facts.gradient_bytes,
        }
        if fixed.to_dict():
            self._registration["fixed"] = fixed.to_dict()
        self._space = space
        self._config = ClientConfig() if config is None else config
        self._reports: queue.Queue[WindowReport] = queue.Queue(QUEUE_LIMIT)
        self._lock = threading.Lock()
        self._latest: ServiceAnswer | None = None
        self._stop = threading.Event()
        self._refused = threading.Event()
        self._healthy = True
        self._after: LeaderClient | None = None
        self._thread = threading.Thread(
            target=self._run, name=f"distune-leader-{name}", daemon=True
        )

    # -- the training thread's side ---------------------------------------------------------

    def start(self, after: LeaderClient | None = None) -> None:
        """Start the background thread (registration happens there). ``after`` is the closed
        client of an older wrapper this one replaced: this one registers once its thread has
        ended (at most one request's time-outs later), never before its last report."""
        self._after = after
        self._thread.start()

    def latest(self) -> ServiceAnswer | None:
        """The service's latest answer, or ``None`` before the first one."""
        with self._lock:
            return self._latest

    def report(self, report: WindowReport) -> None:
        """Queue a finished window for posting; never blocks (drops the oldest if full)."""
        while True:
            try:
                self._reports.put_nowait(report)
                return
            except queue.Full:
                with contextlib.suppress(queue.Empty):
                    self._reports.get_nowait()

    def close(self) -> None:
        """Ask the thread to stop; windows not yet posted are dropped."""
        self._stop.set()

    @property
    def refused(self) -> bool:
        """Whether the service refused to register the model, or a registration with other
        facts replaced it: it is not tuned."""
        return self._refused.is_set()

    @property
    def alive(self) -> bool:
        """Whether the background thread is running."""
        return self._thread.is_alive()

    # -- the background thread --------------------------------------------------------------

    def _run(self) -> None:
        if self._after is not None:
            self._after.wait_ended(self._config.connect_timeout + self._config.read_timeout + 1)
            self._after = None
        session = direct_session()
        registered = False
        delay = self._config.initial_backoff
        try:
            while not self._stop.is_set():
                try:
                    if not registered:
                        self._accept(self._post(session, "register", self._registration))
                        registered = True
                    else:
                        try:
                            report = self._reports.get(timeout=0.2)
                        except queue.Empty:
                            continue
                        registered = self._post_report(session, report)
                except _Refused as refusal:
                    logger.warning(
                        "tuning service at %s refused model %r: %s; this model is not tuned "
                        "(it keeps %s)",
                        self._url,
                        self._name,
                        refusal,
                        self._space.default.describe(),
                    )
                    self._refused.set()
                    return
                except _Superseded as superseded:
                    if not self._stop.is_set():  # else: closed, replaced by a newer wrapper
                        logger.warning(
                            "tuning service at %s no longer tunes model %r: %s; it keeps %s",
                            self._url,
                            self._name,
                            superseded,
                            self._kept().describe(),
                        )
                    self._refused.set()
                    return
                except ServiceError as error:
                    self._failed(str(error))
                    self._stop.wait(delay)
                    delay = min(2 * delay, self._config.max_backoff)
                    continue
                delay = self._config.initial_backoff
                self._recovered()
        finally:
            session.close()

    def wait_ended(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the background thread to end (if it started)."""
        if self._thread.ident is not None:
            self._thread.join(timeout)

    def _post_report(self, session: requests.Session, report: WindowReport) -> bool:
        """Post one window; return whether the model is still registered."""
        try:
            body = self._post(session, "report", report.to_json())
        except _Unknown:
            return False  # the service lost the model (restarted): register again
        if isinstance(body, dict) and body.get("state") == SUPERSEDED:
            raise _Superseded(_error_of(body) or "a registration with other facts replaced it")
        self._accept(body)
        return True

    def _post(self, session: requests.Session, action: str, body: dict[str, Any]) -> Any:
        try:
            response = session.post(
                f"{self._base}/{action}",
                json=body,
                headers=self._headers,
                timeout=(self._config.connect_timeout, self._config.read_timeout),
            )
        except requests.Timeout:
            raise ServiceError("did not answer in time") from None
        except requests.RequestException as error:
            raise ServiceError(f"cannot be reached ({type(error).__name__})") from None
        if response.status_code == 401:
            raise ServiceError("refused the token (401): check DISTUNE_SERVICE_TOKEN")
        if response.status_code == 404 and action == "report":
            raise _Unknown()
        if response.status_code == 409 and action == "register":
            raise _Refused(_error_message(response))
        # 409: the report's group is no longer current; the body carries the current one.
        if response.status_code not in (200, 409):
            raise ServiceError(f"answered {action} with HTTP {response.status_code}")
        try:
            return response.json()
        except ValueError:
            raise ServiceError(f"answered {action} with a body that is not JSON") from None

    def _accept(self, body: Any) -> None:
        answer = self._parse(body)
        with self._lock:
            self._latest = answer

    def _parse(self, body: Any) -> ServiceAnswer:
        try:
            group = body["group"]
            group_id = group["id"]
            if isinstance(group_id, bool) or not isinstance(group_id, int) or group_id < 0:
                raise ValueError(f"group id {group_id!r}")
            hp = Hyperparameters.from_dict(group["hyperparameters"])
            state = body["state"]
            if not isinstance(state, str):
                raise ValueError(f"state {state!r}")
            completed = body.get("completed", state == "completed")
            if not isinstance(completed, bool):
                raise ValueError(f"completed {completed!r}")
        except (KeyError, TypeError, ValueError, HyperparameterError) as error:
            raise ServiceError(f"answered garbage ({error})") from None
        if hp not in self._space:
            raise ServiceError(f"answered a group outside the model's search space ({hp})")
        return ServiceAnswer(group_id, hp, state, completed)

    def _failed(self, reason: str) -> None:
        if self._healthy:
            self._healthy = False
            # Only the leader knows the group the job keeps: name it (the launcher cannot).
            logger.warning(
                "tuning service at %s %s; model %r keeps training with %s; "
                "retrying with back-off (no further warning until it answers)",
                self._url,
                reason,
                self._name,
                self._kept().describe(),
            )
        else:
            logger.debug("tuning service still failing: %s", reason)

    def _kept(self) -> Hyperparameters:
        """The group the job keeps when the service stops answering or tuning it."""
        latest = self.latest()
        return self._space.default if latest is None else latest.hyperparameters

    def _recovered(self) -> None:
        if not self._healthy:
            self._healthy = True
            logger.warning("tuning service at %s answers again", self._url)


class _Unknown(DistuneError):
    """The service does not know the model (404 to a report)."""


class _Refused(DistuneError):
    """The service refused the registration (409); the message is the service's."""


class _Superseded(DistuneError):
    """A registration with other facts replaced this one (409 to a report, state
    ``superseded``); the message is the service's."""


def _error_message(response: requests.Response) -> str:
    """The ``error`` of a REST error body, or a note that the body had none."""
    try:
        body = response.json()
    except ValueError:
        body = None
    return _error_of(body) or f"HTTP {response.status_code} without an error message"


def _error_of(body: Any) -> str | None:
    """The ``error`` of a REST error body, if it has one."""
    error = body.get("error") if isinstance(body, dict) else None
    return None if error is None else str(error)
