"""The tuner-quality benchmark's own parts: measured tables, the grid, the comparison."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from benchmarks.tuner_quality.compare import (
    budget_to_good,
    compare,
    gain_claim_table,
    summary_table,
)
from benchmarks.tuner_quality.landscapes import Landscape, hump_landscape, oracle_tables
from benchmarks.tuner_quality.measurement import NoiseModel
from benchmarks.tuner_quality.tuners import (
    DistuneTuner,
    GridSearch,
    HorovodStyle,
    RandomSearch,
    grid,
)

from distune.space import ModelFacts

FACTS = ModelFacts(world_size=4, nnodes=2, local_world_size=2, gradient_bytes=13_228_032)


def _landscape() -> Landscape:
    return hump_landscape("hump", FACTS, 20.0, 22.0, 1.5, 1.0, 1.05)


def test_a_measured_table_round_trips_and_loads_from_its_directory(tmp_path: Path) -> None:
    landscape = _landscape()
    landscape.dump(tmp_path / "t.json", unit="iterations/s")
    (loaded,) = oracle_tables(tmp_path)
    assert loaded == landscape
    assert json.loads((tmp_path / "t.json").read_text())["unit"] == "iterations/s"


def test_a_table_missing_a_group_is_refused_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    _landscape().dump(path)
    data = json.loads(path.read_text())
    data["throughput"] = [
        row
        for row in data["throughput"]
        if (row["bucket_size_2p"], row["is_hierarchical_reduce"]) != (16, True)
    ]
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"missing.*16"):
        Landscape.load(path)


def test_the_grid_spreads_its_points_over_both_shapes_and_the_bucket_range() -> None:
    space = _landscape().space
    points = grid(space, 6)
    assert len(set(points)) == 6
    for shape in (False, True):
        sizes = sorted(p.bucket_size_2p for p in points if p.is_hierarchical_reduce is shape)
        assert sizes[0] == space.min_bucket_size_2p and sizes[-1] == space.max_bucket_size_2p
    assert grid(space, 40)[: len(list(space))] == list(space)


def test_every_tuner_keeps_a_group_of_the_space_at_every_budget() -> None:
    landscape = _landscape()
    runs = compare(
        [RandomSearch(), GridSearch(), HorovodStyle()], [landscape], 2, [5, 40], NoiseModel()
    )
    assert len(runs) == 6
    for run in runs:
        assert all(0 < f <= 1 for f in run.fractions)
        # With 40 samples every tuner has measured the 18 groups or searched the whole range.
        assert run.fraction_at(40) >= 0.9
    assert "| grid |" in summary_table(runs, [5, 40])


def test_budget_to_good_is_the_budget_from_which_the_curve_stays_within_2_percent() -> None:
    assert budget_to_good({5: 0.99, 10: 0.97, 20: 0.985, 40: 0.99}) == 20
    assert budget_to_good({5: 0.5, 10: 0.97}) == float("inf")


def test_the_claimed_gain_is_set_against_the_true_one() -> None:
    """Without noise distune's claim is exact, so the error is 0 wherever it kept a group
    other than the default; tuners that claim no gain have no error and no table row."""
    landscape = _landscape()
    quiet = NoiseModel(period_sigma=0.0, window_sigma=0.0, stall_rate=0.0, lucky_rate=0.0)
    runs = compare([DistuneTuner(), RandomSearch()], [landscape], 1, [10, 20], quiet)
    distune, random = runs
    default = landscape.space.default
    assert landscape.fraction(default) < 0.9  # so distune keeps another group
    assert distune.gain_error_at(20) == pytest.approx(0.0, abs=1e-9)
    assert random.gain_errors == (None, None)
    table = gain_claim_table(runs, [10, 20])
    assert "| distune | +0.0% / +0.0% (1) | +0.0% / +0.0% (1) |" in table
    assert "random" not in table
