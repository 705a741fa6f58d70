"""The rule that picks the compute-bound testbed job: conditions, ladder end, nearest job."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from benchmarks.testbed.job_rule import Candidate, candidate, choose

MIB = 2**20


def _candidate(name: str, step: float, span_mib: float = 10.0) -> Candidate:
    return Candidate(name, step, 0.1, 80 * MIB, int((80 + span_mib) * MIB))


def test_first_candidate_meeting_all_three_is_the_job() -> None:
    ladder = [_candidate("c64", 0.3), _candidate("c128", 0.6), _candidate("c256", 0.9)]
    job, why = choose(ladder)
    assert job is ladder[1]
    assert why == "the job: c128, cap 85 MiB"


def test_compute_met_but_time_failed_ends_the_ladder_with_the_nearest() -> None:
    ladder = [_candidate("c64", 0.3), _candidate("c128", 0.4), _candidate("c256", 1.6)]
    job, why = choose([*ladder, _candidate("c512", 1.0)])  # never reached: the ladder ended
    assert job is ladder[1]
    assert "NOT the rule's job" in why and "c128, ratio 4.00" in why


def test_memory_failure_is_never_the_job() -> None:
    job, why = choose([_candidate("c64", 0.2, span_mib=6.0)])
    assert job is None
    assert why == "no job: no candidate meets memory and time"


def _profile_row(step: float) -> dict[str, object]:
    facts = {
        "step_seconds": step,
        "peak_memory_bytes": 78_000_000,
        "activation_bytes_per_sample": 4_470_000,
        "checkpointed_activation_bytes_per_sample": 1_580_000,
        "config": {
            "micro_batch": 2,
            "accumulation": 4,
            "stage": 0,
            "checkpointing": False,
            "bf16": False,
        },
        "world_size": 2,
        "parameter_bytes": 13_228_032,
        "gradient_bytes": 13_228_032,
        "largest_block_bytes": 3_159_040,
        "optimizer_state_bytes": 26_456_064,
    }
    return {"trial": 0, "purpose": "profile", "outcome": "ok", "facts": facts}


def test_candidate_reads_the_profile_and_prices_the_allreduce(tmp_path: Path) -> None:
    (tmp_path / "trials.jsonl").write_text(json.dumps(_profile_row(0.5)) + "\n")
    figures = candidate(tmp_path)
    # 2 (n - 1) / n G at 1 gbit/s of TCP payload at MTU 9000: 13.23 MB in 0.1066 s
    assert figures.link_seconds == pytest.approx(13_228_032 * 8 / 1e9 * 9014 / 8948)
    assert figures.peak_quarter < figures.peak_half
    assert figures.ratio == pytest.approx(0.5 / figures.link_seconds)


def test_candidate_refuses_a_run_without_an_ok_profile(tmp_path: Path) -> None:
    row = {**_profile_row(0.5), "outcome": "oom"}
    (tmp_path / "trials.jsonl").write_text(json.dumps(row) + "\n")
    with pytest.raises(ValueError, match="not an ok profile trial"):
        candidate(tmp_path)
