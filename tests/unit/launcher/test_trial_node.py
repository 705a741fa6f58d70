"""A node's part of a level-2 trial: when it stops its ranks early, and how a node other than
node 0 (which has no rank 0 result) tells that its ranks ended well."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from waitress.server import create_server

from distune.launcher import trial_follower
from distune.launcher.level2 import Level2
from distune.launcher.options import OptionError, parse
from distune.launcher.trial_client import TrialClient
from distune.launcher.trial_follower import TrialFollower
from distune.launcher.trial_node import TrialsStoppedError, settings_from_knobs, stop_reason
from distune.launcher.trial_runner import TrialRun, classify
from distune.tuning_service.app import create_app
from distune.tuning_service.service import TuningService
from distune.tuning_service.trial_messages import TrialKnobs
from distune.tuning_service.trials.memory_model import MemoryModel, ModelFacts
from distune.tuning_service.trials.trial_config import TrialConfig, TrialPins
from distune.tuning_service.trials.trial_result import TrialResult
from distune.tuning_service.trials.trial_search import Proposal, TrialSearch
from distune.tuning_service.trials.trial_space import TrialSpace
from tests.support.local_host import free_port

TOKEN = "node-token"


@pytest.fixture
def service_url():
    """A real service app (a fresh trial board) on a free port, served in a thread."""
    server = create_server(create_app(TuningService(), token=TOKEN), host="127.0.0.1", port=0)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.effective_port}"
    server.close()
    thread.join(timeout=10)


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


@pytest.mark.parametrize(
    ("nnodes", "reports", "outcome", "error"),
    [
        # Node 1 never reports: the trial is a timeout, and the search goes on.
        (2, {0: "ok"}, "timeout", "node 1: no report 0.5 s after node 0's ranks ended"),
        # A timeout explains more than a crash; an oom more than a missing node.
        (3, {0: "ok", 1: "crash"}, "timeout", "node 2: no report"),
        (3, {0: "ok", 2: "oom"}, "oom", "node 2: failed as oom"),
    ],
)
def test_node_0_gives_up_on_a_node_that_never_reports(
    service_url, tmp_path, nnodes, reports, outcome, error
):
    client = TrialClient(service_url, TOKEN)
    argv = ["--autotune_level", "2", "--autotune_results_dir", str(tmp_path / "r"), "t.py"]
    args, options = parse(argv)
    level2 = Level2(args, options, TrialPins(), argv, client)
    level2.late_after = 0.5
    client.publish({"trial": 0, "nnodes": nnodes, "purpose": "search", "knobs": {},
                    "master_port": 29600})  # fmt: skip
    for node_rank, reported in reports.items():
        report = {"outcome": reported, "duration": 1.0, "error": f"failed as {reported}"}
        client.report(0, node_rank, report)
    combined = level2._combined(0)
    assert combined["outcome"] == outcome
    assert combined["error"].startswith(error)


def test_node_0_waits_at_the_end_only_for_the_nodes_that_answer(service_url, tmp_path):
    client = TrialClient(service_url, TOKEN)
    argv = ["--nnodes", "3", "--master_addr", "127.0.0.1", "--autotune_level", "2",
            "--autotune_results_dir", str(tmp_path / "r"), "t.py"]  # fmt: skip
    args, options = parse(argv)
    level2 = Level2(args, options, TrialPins(), argv, client)
    level2.late_after = 0.3
    client.publish({"trial": 0, "nnodes": 3, "purpose": "profile", "knobs": {},
                    "master_port": 29600})  # fmt: skip
    for node_rank in (0, 1):
        client.report(0, node_rank, {"outcome": "crash", "duration": 1.0, "error": "E"})
    assert level2._combined(0)["outcome"] == "timeout"  # node 2 never reported
    client.record(0, {"trial": 0, "config": None, "outcome": "timeout"})
    client.finish({"mode": "tune"})
    client.current(node_rank=1)  # node 1 has seen the end; node 2 is gone
    start = time.monotonic()
    level2._wait_acknowledged(20.0)
    assert time.monotonic() - start < 5


def node_args(node_rank: int, *script: str, nproc: str = "2") -> list[str]:
    return ["--nnodes", "2", "--nproc_per_node", nproc, "--node_rank", str(node_rank),
            "--master_addr", "127.0.0.1", "--autotune_level", "2", *script]  # fmt: skip


@pytest.mark.parametrize(
    ("follower", "differs"),
    [
        (["t.py", "--lr", "0.2"], "script_args: ['--lr', '0.1'] on node 0, ['--lr', '0.2'] here"),
        (["--nproc_per_node", "1", "t.py", "--lr", "0.1"], "world_size: 4 on node 0, 2 here"),
    ],
)
def test_a_node_started_with_another_job_than_node_0s_refuses_and_stops_every_node(
    service_url, tmp_path, follower, differs
):
    client = TrialClient(service_url, TOKEN)
    argv = node_args(0, "--autotune_results_dir", str(tmp_path / "r"), "t.py", "--lr", "0.1")
    args, options = parse(argv)
    level2 = Level2(args, options, TrialPins(), argv, client)
    client.publish({"trial": 0, "nnodes": 2, "purpose": "profile", "knobs": {},
                    "master_port": 29600, "job": level2.node_job})  # fmt: skip
    args1, options1 = parse([*node_args(1, "--autotune_results_dir", str(tmp_path)), *follower])
    with pytest.raises(OptionError, match="node 1 was started with another job than node 0's") as e:
        TrialFollower(args1, options1, TrialPins(), client).follow()
    assert differs in str(e.value)
    stop = client.current()["stop"]
    assert stop["node_rank"] == 1
    assert stop["reason"].startswith("node 1 was started with another job than node 0's (its ")
    # Node 0's ranks of the trial are stopped, saying why.
    reason = stop_reason(client.current(0), 0, node_rank=0)
    assert reason is not None and "another job" in reason


def test_a_node_started_with_the_same_job_from_another_directory_takes_part(tmp_path):
    argv = node_args(0, "--autotune_results_dir", str(tmp_path / "r"), "t.py", "--lr", "0.1")
    args, options = parse(argv)
    level2 = Level2(args, options, TrialPins(), argv, TrialClient("http://127.0.0.1:9", TOKEN))
    args1, options1 = parse(
        node_args(1, "--autotune_results_dir", str(tmp_path), "t.py", "--lr", "0.1")
    )
    follower = TrialFollower(args1, options1, TrialPins(), TrialClient("http://x:9", TOKEN))
    follower._check_job(level2.node_job)  # no refusal (the script is compared as given)
    follower._check_job(None)  # a node 0 of an earlier version publishes no job


def test_a_follower_refused_by_node_0s_host_says_so_early_and_keeps_waiting(
    tmp_path, monkeypatch, capsys
):
    # A wrong service URL on node 1 was silent for START_WAIT (300 s) before its one error.
    monkeypatch.setattr(trial_follower, "START_WAIT", 3.0)
    monkeypatch.setattr(trial_follower, "REFUSED_HINT_AFTER", 1.0)
    url = f"http://127.0.0.1:{free_port()}"  # the host answers; nothing listens there
    args1, options1 = parse(node_args(1, "--autotune_results_dir", str(tmp_path), "t.py"))
    started = time.monotonic()
    with pytest.raises(TrialsStoppedError, match=r"connection refused for \d+ s"):
        TrialFollower(args1, options1, TrialPins(), TrialClient(url, TOKEN)).follow()
    assert time.monotonic() - started >= 3.0  # the documented wait is kept
    err = capsys.readouterr().err
    hint = f"distune: node 1: still trying to reach the tuning service at {url}: connection refused"
    assert err.count(hint) == 1, err
    assert "is --autotune_service_addr" in err


def test_a_follower_says_nothing_early_where_the_host_itself_is_unreachable(
    tmp_path, monkeypatch, capsys
):
    # Not a refused connection: the refused-connection hint would be wrong.
    monkeypatch.setattr(trial_follower, "START_WAIT", 1.5)
    monkeypatch.setattr(trial_follower, "REFUSED_HINT_AFTER", 0.0)
    args1, options1 = parse(node_args(1, "--autotune_results_dir", str(tmp_path), "t.py"))
    client = TrialClient("http://no-such-host.invalid:9", TOKEN)
    with pytest.raises(TrialsStoppedError, match="ConnectionError for"):
        TrialFollower(args1, options1, TrialPins(), client).follow()
    assert "still trying" not in capsys.readouterr().err


class MeasuredRunner:
    """Stands in for the TrialRunner of node 0: each trial ends ok with made-up measurements
    (what level 2 records of it is under test, not the trial)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def run(self, index, settings, script_args, master_port, abort=None) -> TrialRun:
        measurements = {"throughput": 100.0, "throughput_spread": 0.1, "step_seconds": 0.2,
                        "peak_memory_bytes": 2**20}  # fmt: skip
        return TrialRun("ok", 0, measurements, None, 1.0, self.root / "log.txt", 2**20, steps=7)


def test_a_trial_that_changed_the_global_batch_says_so_in_its_record_and_the_summary(
    service_url, tmp_path
):
    client = TrialClient(service_url, TOKEN)
    results = tmp_path / "r"
    argv = ["--nproc_per_node", "2", "--autotune_level", "2", "--autotune_results_dir",
            str(results), "--autotune_allow_batch_change", "t.py"]  # fmt: skip
    args, options = parse(argv)
    level2 = Level2(args, options, TrialPins(), argv, client)
    level2.node.runner = MeasuredRunner(tmp_path)  # type: ignore[assignment]
    own = TrialConfig(2, 4, 0, False)
    profile = TrialResult(0, own, 2, "ok", "profile", 50.0, 0.1, 0.32, 2**20)
    level2.report.add(profile)
    client.record(0, profile.to_json())
    space = TrialSpace(TrialPins(), 2, own, allow_batch_change=True)
    facts = ModelFacts(2**16, 2**16, 2**17, 2**14, 2**10, own, 2**20, 2)
    search = TrialSearch(space, MemoryModel(facts), None, 4, "throughput")
    search.record(profile)
    larger = TrialConfig(8, 4, 0, False)
    level2._run_proposal(search, Proposal(larger, "search", None))
    record = json.loads((results / "trials.jsonl").read_text().splitlines()[1])
    # The record of a trial of another global batch says so (it was always null before).
    assert record["batch_change"] == "global batch 16 -> 64 (--autotune_allow_batch_change)"
    assert search.results[1].batch_change == record["batch_change"]
    level2.report.finish(search, search.decisions, 2.0)
    summary = (results / "summary.md").read_text()
    assert "| 1 | search | ddp, micro-batch 8 x 4, global batch 64 | ok |" in summary
    assert "| 0 | profile | ddp, micro-batch 2 x 4 | ok |" in summary
    assert "**Best:** ddp, micro-batch 8 x 4, global batch 64: 100.000 samples/s" in summary
    assert "gain 2.00x (the winner trains global batch 64 against the script's 16" in summary
