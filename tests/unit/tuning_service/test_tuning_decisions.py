"""Choosing the next group off the request path: the report that finishes a sample is answered
at once, the choice is published later, and it is the same choice as made inline."""

import itertools
import math
import time
from concurrent.futures import Executor, Future, ThreadPoolExecutor

import pytest

from distune.space import Hyperparameters
from distune.tuning_service.config import TuningConfig
from distune.tuning_service.messages import Registration, Report
from distune.tuning_service.service import TuningService
from distune.tuning_service.session import StaleGroupError, State
from tests.support.models import MULTI_NODE as FACTS

CONFIG = TuningConfig(
    max_samples=8, sampling_confidence_time=2.0, min_windows=2, warmup_time=0.0, seed=4
)


class StepExecutor(Executor):
    """Runs submitted work only when told: the test decides when the worker gets to run."""

    def __init__(self) -> None:
        self.queue: list[tuple[Future, object]] = []

    def submit(self, fn, /, *args, **kwargs):
        future: Future = Future()
        self.queue.append((future, lambda: fn(*args, **kwargs)))
        return future

    def run_all(self) -> int:
        ran = 0
        while self.queue:
            future, work = self.queue.pop(0)
            future.set_result(work())
            ran += 1
        return ran


def rate(hp: Hyperparameters) -> float:
    """A landscape peaking at 2^21 B, hierarchical 5% faster."""
    peak = 100.0 * math.exp(-(((hp.bucket_size_2p - 21) / 2.5) ** 2)) + 20.0
    return peak * (1.05 if hp.is_hierarchical_reduce else 1.0)


def window(group_id: int, hp: Hyperparameters, step: int, jitter: float = 0.02) -> Report:
    """One second of training under ``hp``, with a little jitter that depends on the group and
    the step within it, so that the same windows of a group score the same."""
    iterations = round(rate(hp) * (1.0 + jitter * math.sin(7 * group_id + step)))
    return Report(group_id, step, iterations, 1.0)


def drive(
    service: TuningService, executor: StepExecutor | None, jitter: float = 0.02, limit: int = 500
):
    """A job following the service: it runs the group it last heard of, learning a new one
    from report answers, 409s and polls; the executor's work runs between reports."""
    group = service.register("m", Registration(FACTS)).group
    step = 0
    for _ in range(limit):
        if executor is not None:
            executor.run_all()
        try:
            reply = service.report("m", window(group.id, group.hyperparameters, step, jitter))
            step += 1
        except StaleGroupError as stale:
            reply = stale.reply
        if reply.group != group:
            group, step = reply.group, 0
        if reply.completed:
            return service.views()[0]
    raise AssertionError("tuning did not complete")


def test_the_finishing_report_is_answered_before_the_choice():
    executor = StepExecutor()
    service = TuningService(CONFIG, decisions=executor)
    group = service.register("m", Registration(FACTS)).group
    service.report("m", window(group.id, group.hyperparameters, 0))  # discarded
    service.report("m", window(group.id, group.hyperparameters, 1))
    reply = service.report("m", window(group.id, group.hyperparameters, 2))  # 2 s: finished
    assert reply.group == group and reply.state is State.SAMPLING
    assert len(executor.queue) == 1
    view = service.views()[0]
    assert view.samples == 1 and view.records[0].windows == 2
    # Until the choice is made, windows belong to a finished sample: answered, not scored.
    for step in range(3, 6):
        assert service.report("m", window(group.id, group.hyperparameters, step)).group == group
    assert service.views()[0].records == view.records
    assert executor.run_all() == 1
    chosen = service.hyperparameters("m").group
    assert chosen.id == group.id + 1
    with pytest.raises(StaleGroupError) as stale:
        service.report("m", window(group.id, group.hyperparameters, 6))
    assert stale.value.reply.group == chosen


def test_choices_off_the_request_path_are_the_choices_made_inline():
    inline = drive(TuningService(CONFIG), None)
    executor = StepExecutor()
    background = drive(TuningService(CONFIG, decisions=executor), executor)

    def decisions(view):
        return [(r.group.hyperparameters, r.phase, round(r.score, 9)) for r in view.records]

    assert decisions(background) == decisions(inline)
    assert background.best.group.hyperparameters == inline.best.group.hyperparameters
    assert background.state is State.COMPLETED


def test_a_worker_thread_tunes_to_the_same_choice():
    inline = drive(TuningService(CONFIG), None, jitter=0.0)
    with ThreadPoolExecutor(max_workers=1) as executor:
        service = TuningService(CONFIG, decisions=executor)
        group = service.register("m", Registration(FACTS)).group
        deadline = time.monotonic() + 60.0
        for step in itertools.count():
            assert time.monotonic() < deadline, "tuning did not complete"
            time.sleep(0.002)  # a job reports now and then, not in a tight loop
            try:
                reply = service.report("m", window(group.id, group.hyperparameters, step, 0.0))
            except StaleGroupError as stale:
                reply = stale.reply
            if reply.completed:
                break
            group = service.hyperparameters("m").group  # polling, as the runtime does
        view = service.views()[0]
    assert view.state is State.COMPLETED
    # Which windows arrive while a choice is being made depends on timing; on a landscape
    # without noise that changes no score, so every choice is the same.
    assert [r.group.hyperparameters for r in view.records] == [
        r.group.hyperparameters for r in inline.records
    ]
