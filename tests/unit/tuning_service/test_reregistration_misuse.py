"""A model registered again with other facts, used the wrong way round: races between a
registration and a report, what the best-file then says, and how reports of other
registrations are told apart (docs/tuning_service.md, "Re-registration")."""

import json
import threading
from types import TracebackType

import pytest

from distune.tuning_service.config import TuningConfig
from distune.tuning_service.messages import Registration, Report
from distune.tuning_service.service import SupersededError, TuningService
from tests.unit.tuning_service.test_tuning_reregistration import (
    HEAD,
    UNFROZEN,
    completed,
    make_job,
)

CONFIG = TuningConfig(
    max_samples=4, sampling_confidence_time=2.0, min_windows=2, warmup_time=0.0, seed=3
)


class ContendedLock:
    """A session's lock that says when a thread finds it held and starts waiting for it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.waited = threading.Event()

    def __enter__(self) -> None:
        if not self._lock.acquire(blocking=False):
            self.waited.set()
            self._lock.acquire()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._lock.release()


def test_a_report_that_waited_while_its_registration_was_replaced_is_superseded():
    # Two models under one name (two jobs on one service): model A's report has read which
    # registration is current and waits for its session's lock, which a registration of model
    # B holds while it replaces A's session. Before, the report went on into A's replaced
    # session: it finished A's sample there and moved A to group 1, the id B's new session had
    # just been given, so A's next reports (group 1) were scored as B's default group.
    service = TuningService(CONFIG)
    service.register("m", Registration.from_json(HEAD))
    service.report("m", Report(0, 1, 100, 1.0))  # discarded: the registration's window
    service.report("m", Report(0, 2, 100, 1.0))  # one window more finishes the sample
    model = service._models["m"]
    replaced = model.current
    replaced.lock = ContendedLock()  # type: ignore[assignment]
    outcome: dict[str, object] = {}

    def late_report() -> None:
        try:
            outcome["reply"] = service.report("m", Report(0, 3, 100, 1.0))
        except SupersededError as error:
            outcome["superseded"] = error

    with replaced.lock:
        thread = threading.Thread(target=late_report)
        thread.start()
        # The report has looked the registration up and waits for its lock (a fixed sleep here
        # was not always long enough on a loaded machine).
        assert replaced.lock.waited.wait(10), "the late report never waited for the lock"
        # What register() does with the session's lock held: B's facts replace A's session.
        with service._lock:
            new = service._replace(model, Registration.from_json(UNFROZEN), replaced.session.fixed)
    thread.join(5)
    assert "superseded" in outcome, f"the late report was scored: {outcome}"
    status = service.status()["models"]["m"]
    [earlier] = status["earlier"]
    assert earlier["samples"] == 0 and earlier["current"]["id"] == 0, "A's session moved on"
    assert earlier["superseded_reports"] == 1
    assert new.group.id == status["current"]["id"] == 1
    # B's reports are its own; a report of A's group 0 stays A's.
    assert service.report("m", Report(1, 10, 100, 1.0)).group.id == 1
    with pytest.raises(SupersededError):
        service.report("m", Report(0, 11, 100, 1.0))


def test_the_best_files_settings_are_never_an_earlier_shapes_choice(tmp_path):
    # The best-file's top-level keys are a launcher config: --autotune_config BEST_FILE pins the
    # next job's knobs to them. Before, a model registered again with other facts (unfrozen:
    # 64x the gradient bytes) whose new session never completed left the head's 1 MiB choice
    # there, so the next job would have trained the whole model on 1 MiB buckets, untuned.
    path = tmp_path / "best.json"
    job = make_job(tmp_path)
    job.register(HEAD)
    job.run_until(completed)
    head_choice = job.status()["best"]["group"]
    assert json.loads(path.read_text())["bucket_size"] == 2**20
    job.register(UNFROZEN)
    document = json.loads(path.read_text())
    assert "bucket_size" not in document and "hierarchical_reduce" not in document
    # The head's choice is still on record, as the model's latest completed session.
    assert document["autotune_result"]["models"]["m"]["group"] == head_choice
    job.run_until(completed)
    document = json.loads(path.read_text())
    chosen = job.status()["best"]["group"]["hyperparameters"]
    assert document["bucket_size"] == 2 ** chosen["bucket_size_2p"] != 2**20
    assert document["autotune_result"]["models"]["m"]["group"]["hyperparameters"] == chosen
