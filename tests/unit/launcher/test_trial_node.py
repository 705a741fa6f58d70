"""A node's part of a level-2 trial: when it stops its ranks early, and how a node other than
node 0 (which has no rank 0 result) tells that its ranks ended well."""

from __future__ import annotations

import pytest

from distune.launcher.trial_node import settings_from_knobs, stop_reason
from distune.launcher.trial_runner import classify
from distune.tuning_service.trial_messages import TrialKnobs


def current(state="tuning", trial=3, trial_state="running", nodes=None, stop=None):
    return {
        "state": state,
        "trial": {"trial": trial, "state": trial_state, "nodes": nodes or {}},
        "stop": stop,
    }


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        (current(), None),
        # This node's own report does not stop it; a peer's ok report neither.
        (current(nodes={"1": {"outcome": "crash", "stopped": False}}), None),
        (current(nodes={"0": {"outcome": "ok", "stopped": False}}), None),
        # A peer that failed on its own stops this node; one stopped by another does not.
        (current(nodes={"0": {"outcome": "oom", "stopped": False}}), "node 0 ended oom"),
        (current(nodes={"2": {"outcome": "crash", "stopped": True}}), None),
        (current(trial_state="recorded"), "node 0 closed trial 3"),
        (current(trial=4), "node 0 closed trial 3"),
        (
            current(state="stopped", stop={"node_rank": 2, "reason": "SIGINT"}),
            "node 2 stopped the trials (SIGINT)",
        ),
    ],
)
def test_a_node_stops_its_ranks_when_the_service_says_the_trial_cannot_finish(answer, reason):
    assert stop_reason(answer, 3, node_rank=1) == reason


@pytest.mark.parametrize(
    ("exit_code", "reports", "expected"),
    [
        (0, [{"outcome": "ok"}, {"outcome": "ok"}], "ok"),
        (0, [{"outcome": "ok"}], "ok"),
        (0, [], "invalid"),  # no rank reported: the script never measured
        (1, [{"outcome": "ok"}, {"outcome": "crash", "error": "E"}], "crash"),
        (-9, [{"outcome": "ok"}], "oom"),  # a rank killed as the kernel's OOM killer does
    ],
)
def test_a_node_without_rank_0_is_ok_when_each_of_its_ranks_is(exit_code, reports, expected):
    outcome, _ = classify(exit_code, False, reports, None, "", expects_result=False)
    assert outcome == expected
    # Node 0 needs rank 0's result as well.
    if expected == "ok":
        assert classify(exit_code, False, reports, None, "")[0] == "invalid"


def test_published_knobs_become_the_ranks_settings_with_this_nodes_cap():
    knobs = TrialKnobs.from_json({"micro_batch": 4, "stage": 3, "checkpointing": True})
    settings = settings_from_knobs(knobs, 2**26)
    assert (settings.micro_batch, settings.accumulation, settings.stage) == (4, None, 3)
    assert settings.checkpointing is True and settings.device_memory == 2**26
