"""The zero1 A/B's paired comparison, on run directories written as ``measure`` writes them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from benchmarks.testbed.zero1_ab import compare, geometric_interval, read_runs

DDP, ZERO1 = "ddp, micro-batch 2 x 4", "zero1, micro-batch 2 x 4"


def _run(root: Path, name: str, rows: dict[tuple, float]) -> None:
    (root / name).mkdir()
    table = {
        "rows": [
            {"config": list(config), "outcome": "ok", "throughput": value, "peak_memory_bytes": 7}
            for config, value in rows.items()
        ]
        + [{"config": [8, 1, 1, False, False], "outcome": "oom", "throughput": None}]
    }
    (root / name / "grid.json").write_text(json.dumps(table), encoding="utf-8")


def test_rounds_pair_the_variants_and_an_unfinished_round_is_left_out(tmp_path: Path) -> None:
    ddp, zero1 = (2, 4, 0, False, False), (2, 4, 1, False, False)
    for r, (stock, bucket) in enumerate([(50.0, 55.0), (40.0, 44.0), (60.0, 66.0)], start=1):
        _run(tmp_path, f"r{r:02d}-v0", {ddp: 100.0, zero1: stock})
        _run(tmp_path, f"r{r:02d}-v1", {ddp: 100.0, zero1: bucket})
    _run(tmp_path, "r04-v0", {ddp: 100.0, zero1: 1.0})  # its bucket-view run never finished
    runs = read_runs(tmp_path)
    assert runs[(1, 0)] == {DDP: (100.0, 7), ZERO1: (50.0, 7)}  # no oom row
    lines = compare(runs)
    assert f"{ZERO1}: bucket / stock 1.100 (95 % 1.100-1.100), n = 3" in "\n".join(lines)
    assert f"{DDP}: bucket / stock 1.000" in "\n".join(lines)
    assert any(
        line.startswith(f"{ZERO1} / {DDP} in the same run, stock: median 0.500") for line in lines
    )


def test_the_interval_is_the_geometric_mean_and_its_t_interval() -> None:
    mean, low, high = geometric_interval([1.0, 1.21])
    assert mean == pytest.approx(1.1)
    assert low < 1.0 < 1.21 < high  # two pairs: a wide interval (t = 12.7)


def test_fewer_than_two_complete_rounds_is_an_error(tmp_path: Path) -> None:
    _run(tmp_path, "r01-v0", {(2, 4, 1, False, False): 1.0})
    _run(tmp_path, "r01-v1", {(2, 4, 1, False, False): 1.0})
    with pytest.raises(SystemExit, match="at least 2 complete rounds"):
        compare(read_runs(tmp_path))
