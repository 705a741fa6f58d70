"""Which registration of a model a tuning-log row belongs to.

A model registered again with other facts (wrapped again after unfreezing layers, restarted on
other nodes) is tuned afresh in a new session (docs/tuning_service.md, "Re-registration"). Its
rows start again at a ``default`` sample 1, which no session writes but first, and its group ids
lie above every earlier session's. So a row belongs to the latest session begun at or below its
group id, even a choice an earlier session logged after the next one began (its decision came
late); in a log without group ids (an older version's), to the latest session begun before it.
The launcher's progress lines and ``distune log``/``plot`` read a log by this one rule.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

#: The phase of a session's first sample, the default group's.
DEFAULT_PHASE = "default"


def registration_of(rows: Sequence[tuple[str, int | None, int | None]]) -> list[int]:
    """Each of one model's log rows, given as ``(phase, sample, group id)`` in file order (None
    where the log has no readable value), numbered by the registration it belongs to, from 0."""
    starts = [phase == DEFAULT_PHASE and sample == 1 for phase, sample, _ in rows]
    ids = [group_id for _, _, group_id in rows]
    firsts = sorted({i for i, start in zip(ids, starts, strict=True) if start and i is not None})
    known = [i for i in ids if i is not None]
    if firsts and len(known) == len(ids):
        return [max(0, bisect.bisect_right(firsts, i) - 1) for i in known]
    numbers, current = [], 0
    for position, start in enumerate(starts):
        current += bool(position and start)
        numbers.append(current)
    return numbers
