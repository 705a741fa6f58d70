"""Report windows to an in-process tuning service as the worker's leader does."""

from __future__ import annotations

from distune.tuning_service.messages import Report
from distune.tuning_service.service import TuningService
from distune.tuning_service.session import Reply, StaleGroupError


def report(
    service: TuningService,
    name: str,
    reply: Reply,
    train_iter: int,
    iterations: int,
    seconds: float = 0.5,
) -> Reply:
    """Report ``iterations`` done in ``seconds`` under ``reply``'s group; the answer. A report
    for a group no longer current is answered 409 with the current group, which the leader
    takes as its answer: so does this."""
    try:
        return service.report(name, Report(reply.group.id, train_iter, iterations, seconds))
    except StaleGroupError as error:
        return error.reply
