"""The rules that pick the testbed job: conditions, ladder end, nearest job (context and samples)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from benchmarks.testbed.job_rule import (
    Candidate,
    SamplesCandidate,
    candidate,
    choose,
    choose_by_samples,
    main,
    samples_candidate,
)

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
    assert figures.peak_start < figures.peak_double
    assert figures.ratio == pytest.approx(0.5 / figures.link_seconds)


def test_candidate_refuses_a_run_without_an_ok_profile(tmp_path: Path) -> None:
    row = {**_profile_row(0.5), "outcome": "oom"}
    (tmp_path / "trials.jsonl").write_text(json.dumps(row) + "\n")
    with pytest.raises(ValueError, match="not an ok profile trial"):
        candidate(tmp_path)


def _samples(
    name: str, step: float, reach: int = 4, gain: float = 1.2, span_mib: float = 10.0
) -> SamplesCandidate:
    return SamplesCandidate(_candidate(name, step, span_mib), 2, reach, ((4, gain), (8, gain)))


def test_samples_rule_takes_the_first_candidate_meeting_all_five() -> None:
    ladder = [
        _samples("m16", 0.4),  # compute fails: ratio 4
        _samples("m32", 0.8, reach=2),  # the cap stops sharding where it stops DDP
        _samples("m64", 1.2, gain=1.10),  # a larger micro-batch does not pay
        _samples("m128", 1.4),
    ]
    job, why = choose_by_samples(ladder)
    assert job is ladder[3]
    assert why == "the job: m128, cap 85 MiB"
    assert [c.met for c in ladder] == [2, 1, 2, 3]


def test_samples_rule_names_the_nearest_when_none_meets_it_and_time_ends_the_ladder() -> None:
    ladder = [
        _samples("m16", 0.4, gain=1.16),  # all but compute
        _samples("m32", 0.8, gain=1.12),  # all but pays, a smaller gain: the tie goes to m16
        _samples("m64", 1.6),  # time fails: the ladder ends
    ]
    job, why = choose_by_samples([*ladder, _samples("m128", 1.0)])  # never reached
    assert job is ladder[0]
    assert "NOT the rule's job" in why and "m16, 2 of 3, cap 85 MiB" in why
    job, why = choose_by_samples([_samples("m16", 0.8, span_mib=6.0)])
    assert job is None and why == "no job: no candidate meets memory and time"


def _profile_at(root: Path, micro_batch: int, step: float, per_rank: int = 16) -> Path:
    row = _profile_row(step)
    config = row["facts"]["config"]  # type: ignore[index]
    config.update(micro_batch=micro_batch, accumulation=per_rank // micro_batch)
    directory = root / f"mb{micro_batch}"
    directory.mkdir()
    (directory / "trials.jsonl").write_text(json.dumps(row) + "\n")
    return directory


def test_samples_candidate_measures_the_gain_at_the_micro_batch_sharding_reaches(
    tmp_path: Path,
) -> None:
    start, double = _profile_at(tmp_path, 2, 0.6), _profile_at(tmp_path, 4, 0.55)
    quadruple = _profile_at(tmp_path, 8, 0.3)
    figures = samples_candidate([start, double, quadruple])
    # under the 78 MiB cap zero1 fits micro-batch 4 (it sheds half the optimizer state) but no
    # stage fits 8, so the gain that counts is at 4 (0.6 / 0.55), not at 8 (0.6 / 0.3)
    assert (figures.base.cap_mib, figures.reach) == (78, 4)
    assert figures.gain == pytest.approx(0.6 / 0.55)
    assert figures.shards and not figures.pays
    assert samples_candidate([start, quadruple]).gain is None  # the reach was not profiled


def test_samples_candidate_refuses_a_profile_of_another_batch(tmp_path: Path) -> None:
    start = _profile_at(tmp_path, 2, 0.6)
    other = _profile_at(tmp_path, 4, 0.5, per_rank=8)
    with pytest.raises(ValueError, match="not DDP at 16 samples a rank"):
        samples_candidate([start, other])
    with pytest.raises(SystemExit):
        main(["--samples", f"{start},{other}"])
