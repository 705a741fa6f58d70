"""Level 2's results directory: trials.jsonl line by line, summary.md's rows and gain."""

from __future__ import annotations

import json
from pathlib import Path

from distune.launcher.trial_report import TrialReport
from distune.tuning_service.trials.memory_model import MemoryModel, ModelFacts
from distune.tuning_service.trials.trial_config import TrialConfig, TrialPins
from distune.tuning_service.trials.trial_result import LATENCY, THROUGHPUT, TrialResult
from distune.tuning_service.trials.trial_search import TrialSearch
from distune.tuning_service.trials.trial_space import TrialSpace

PROFILE = TrialConfig(2, 2, 0, False)
FAST = TrialConfig(4, 1, 1, False)


def results() -> list[TrialResult]:
    return [
        TrialResult(0, PROFILE, 2, "ok", "profile", 10.0, 0.1, 0.8, 100, None, 5.0),
        TrialResult(1, FAST, 2, "ok", "search", 20.0, 0.1, 0.4, 120, 110, 5.0),
        TrialResult(2, TrialConfig(4, 1, 3, False), 2, "crash", error="ValueError: boom"),
    ]


def report(tmp_path: Path, metric: str) -> str:
    space = TrialSpace(TrialPins(), 2, PROFILE)
    facts = ModelFacts(10, 10, 20, 1, 5, PROFILE, 100, 2)
    search = TrialSearch(space, MemoryModel(facts), None, 10, metric)
    writer = TrialReport(tmp_path, metric)
    for result in results():
        search.record(result)
        writer.add(result)
    writer.finish(search, search.decisions, 12.0)
    return (tmp_path / "summary.md").read_text()


def test_trials_jsonl_has_a_line_per_trial_with_the_fixed_fields(tmp_path: Path) -> None:
    report(tmp_path, THROUGHPUT)
    lines = [json.loads(line) for line in (tmp_path / "trials.jsonl").read_text().splitlines()]
    assert [line["trial"] for line in lines] == [0, 1, 2]
    required = {
        "trial",
        "config",
        "outcome",
        "throughput",
        "peak_memory_bytes",
        "predicted_memory_bytes",
    }
    assert all(required <= set(line) for line in lines)
    assert lines[2]["throughput"] is None and lines[2]["outcome"] == "crash"


def test_summary_has_a_row_per_strategy_the_gain_and_the_errors(tmp_path: Path) -> None:
    summary = report(tmp_path, THROUGHPUT)
    assert "| ddp | 1 | 1 | 10.00 | 0: ddp, micro-batch 2 x 2 |" in summary
    assert "| zero1 | 1 | 1 | 20.00 | 1: zero1, micro-batch 4 x 1 |" in summary
    assert "| zero3 | 1 | 0 | - |" in summary
    assert "gain 2.00x" in summary
    assert "ValueError: boom" in summary


def test_latency_summary_reports_seconds_a_step_and_the_speed_up(tmp_path: Path) -> None:
    summary = report(tmp_path, LATENCY)
    assert "latency (minimised)" in summary
    assert "**Best:** zero1, micro-batch 4 x 1: 0.400 s/step" in summary
    assert "gain 2.00x" in summary


def test_a_run_stopped_before_its_search_ended_says_so_in_its_summary(tmp_path: Path) -> None:
    space = TrialSpace(TrialPins(), 2, PROFILE)
    search = TrialSearch(
        space, MemoryModel(ModelFacts(10, 10, 20, 1, 5, PROFILE, 100, 2)), None, 10
    )
    writer = TrialReport(tmp_path, THROUGHPUT)
    for result in results()[:2]:
        search.record(result)
        writer.add(result)
    writer.finish(search, search.decisions, 12.0, stopped="SIGINT")
    summary = (tmp_path / "summary.md").read_text()
    assert summary.startswith(
        "# distune level 2\n\n**Stopped** (SIGINT) after 2 recorded trial(s), before the search "
        "ended: nothing was chosen; the best below is the best so far, and "
        f"`--autotune_resume {tmp_path}` reuses these trials for the same job."
    )
    assert "**Best so far:** zero1, micro-batch 4 x 1" in summary
    assert "| 1 | search | zero1, micro-batch 4 x 1 | ok |" in summary


def test_a_failed_profile_is_not_described_by_knobs_it_never_learned(tmp_path: Path) -> None:
    # The script ran its own batch (say 32), which nothing told distune: the record holds 1.
    failed = TrialResult(
        0, TrialConfig(1, 1, 0, False), 2, "oom", "profile", error="CUDA out of memory"
    )
    writer = TrialReport(tmp_path, THROUGHPUT)
    writer.add(failed)
    assert writer.line(failed) == (
        "trial 0: the script's own configuration (not measured): oom (CUDA out of memory) "
        "after 0.0 s"
    )
    writer.finish(None, [], 1.0)
    summary = (tmp_path / "summary.md").read_text()
    assert "| ddp | 1 | 0 | - | - |" in summary
    assert "| 0 | profile | the script's own configuration (not measured) | oom |" in summary
    assert "micro-batch 1 x 1" not in summary
