"""Which ranks a failed trial names as having ended early (torch's agent's failures)."""

from __future__ import annotations

import pytest
from torch.distributed.elastic.multiprocessing.api import SubprocessContext
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from distune.launcher.trial_job import ended_ranks


def failed(*local_ranks: int) -> ChildFailedError:
    """Node 1's failure (local ranks 0-2 are ranks 3-5) with ``local_ranks`` in failures."""
    return ChildFailedError(
        "script.py",
        {
            3 + local: ProcessFailure(
                local, 1000 + local, 1 if local == local_ranks[0] else -15, ""
            )
            for local in local_ranks
        },
    )


def test_ranks_absent_from_failures_that_record_stopped_ranks_ended_early() -> None:
    # Local rank 0 failed, 2 was stopped by the agent: 1 had exited with status 0.
    assert ended_ranks(failed(0, 2), 3, 3) == [4]
    assert ended_ranks(failed(0, 1, 2), 3, 3) == []


def test_no_rank_is_named_where_the_agent_leaves_stopped_ranks_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # An older torch: local rank 2, stopped, is as absent as one that ended; name neither.
    monkeypatch.delattr(SubprocessContext, "_capture_process_failures")
    assert ended_ranks(failed(0), 3, 3) == []
