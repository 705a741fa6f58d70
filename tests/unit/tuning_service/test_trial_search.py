"""Level 2's torch-free trial search: the space, the memory model and the policy.

The policy runs against a simulated job whose true peak memory and throughput are known, so
each test can say what the right next trial is.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace

import pytest

from distune.tuning_service.trials.memory_model import MemoryModel, ModelFacts
from distune.tuning_service.trials.trial_config import TrialConfig, TrialConfigError, TrialPins
from distune.tuning_service.trials.trial_result import (
    CRASH,
    LATENCY,
    OK,
    OOM,
    THROUGHPUT,
    TrialResult,
)
from distune.tuning_service.trials.trial_search import TrialSearch
from distune.tuning_service.trials.trial_space import TrialSpace

MiB = 2**20
WORLD = 2
BASELINE = TrialConfig(micro_batch=2, accumulation=8, stage=0, checkpointing=False)


def facts(activation: int = 10 * MiB) -> ModelFacts:
    """A model of 100 MiB of parameters with Adam (2x state), profiled at BASELINE."""
    return ModelFacts(
        parameter_bytes=100 * MiB,
        gradient_bytes=100 * MiB,
        optimizer_state_bytes=200 * MiB,
        largest_block_bytes=10 * MiB,
        activation_bytes_per_sample=activation,
        profile=BASELINE,
        profile_peak_bytes=400 * MiB + 2 * activation + 5 * MiB,
        world_size=WORLD,
    )


def true_peak(config: TrialConfig) -> int:
    """The simulated job's real peak: the formula, 5 MiB of slack, checkpointing saves 70%,
    and without accumulation part of the gradients never coexists with the activations."""
    activation = 10 * MiB * (0.3 if config.checkpointing else 1.0)
    return round(
        facts().state_bytes(config.stage)
        + 5 * MiB
        + activation * config.micro_batch
        - facts().unaccumulated_bytes(config)
    )


def speed(config: TrialConfig) -> float:
    """Samples a second: larger micro-batches help, sharding and recomputation cost."""
    return (
        100.0
        * (1 - 0.5 / (1 + config.micro_batch))
        * (1 - 0.04 * config.stage)
        * (0.75 if config.checkpointing else 1.0)
    )


def run_search(
    search: TrialSearch,
    cap: int | None,
    throughput: Callable[[TrialConfig], float] = speed,
    peak_of: Callable[[TrialConfig], int] = true_peak,
) -> list[TrialResult]:
    """Drive ``search`` to the end against the simulated job."""
    ran: list[TrialResult] = []
    while (proposal := search.next_trial()) is not None:
        config = proposal.config
        peak = peak_of(config)
        ok = cap is None or peak <= cap
        samples = throughput(config)
        result = TrialResult(
            trial=len(search.results),
            config=config,
            world_size=WORLD,
            outcome=OK if ok else OOM,
            purpose=proposal.purpose,
            throughput=samples if ok else None,
            step_seconds=config.global_batch(WORLD) / samples if ok else None,
            peak_memory_bytes=peak if ok else None,
            predicted_memory_bytes=proposal.predicted_memory_bytes,
        )
        search.record(result)
        ran.append(result)
    return ran


def new_search(
    cap: int | None,
    pins: TrialPins | None = None,
    max_trials: int = 30,
    metric: str = THROUGHPUT,
    allow_batch_change: bool = False,
) -> TrialSearch:
    space = TrialSpace(pins or TrialPins(), WORLD, BASELINE, allow_batch_change)
    return TrialSearch(space, MemoryModel(facts()), cap, max_trials, metric)


# -- the space -------------------------------------------------------------------------------


def test_micro_batches_hold_the_global_batch() -> None:
    space = TrialSpace(TrialPins(), WORLD, BASELINE)
    assert space.global_batch == 32
    assert space.micro_batches() == (1, 2, 4, 8, 16)
    assert {space.config(0, False, m).global_batch(WORLD) for m in space.micro_batches()} == {32}


def test_pinned_values_restrict_the_space() -> None:
    pins = TrialPins(accumulation=4, stage=2, checkpointing=False)
    space = TrialSpace(pins, WORLD, BASELINE)
    assert space.micro_batches() == (4,)
    assert space.stages() == (2,)
    assert space.checkpointing() == (False,)


def test_pinned_global_batch_wins_over_the_baseline() -> None:
    space = TrialSpace(TrialPins(global_batch=8), WORLD, BASELINE)
    assert space.micro_batches() == (1, 2, 4)


def test_batch_change_keeps_accumulation_and_says_what_changed() -> None:
    space = TrialSpace(TrialPins(), WORLD, BASELINE, allow_batch_change=True)
    assert 64 in space.micro_batches()
    config = space.config(0, False, 4)
    assert config.accumulation == BASELINE.accumulation
    assert space.batch_change(config) == "global batch 32 -> 64 (--autotune_allow_batch_change)"


@pytest.mark.parametrize(
    ("pins", "message"),
    [
        (TrialPins(global_batch=33), "does not divide among 2 ranks"),
        (TrialPins(micro_batch=3), "no micro-batch x accumulation gives"),
        (TrialPins(micro_batch=2, accumulation=2, global_batch=16), "is not"),
    ],
)
def test_impossible_pins_are_refused(pins: TrialPins, message: str) -> None:
    with pytest.raises(TrialConfigError, match=message):
        TrialSpace(pins, WORLD, BASELINE)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"train_micro_batch_size_per_gpu": 0}, "train_micro_batch_size_per_gpu must be"),
        ({"zero_optimization": {"stage": 4}}, "stage 0, 1, 2 or 3"),
        ({"activation_checkpointing": "yes"}, "activation_checkpointing must be"),
        ({"arg_mappings": {"train_batch_size": "--bs"}}, "cannot map 'train_batch_size'"),
        ({"arg_mappings": {"gradient_accumulation_steps": "accum"}}, "one of the script's flags"),
    ],
)
def test_bad_config_values_name_the_key(data: dict, message: str) -> None:
    with pytest.raises(TrialConfigError, match=message):
        TrialPins.from_config(data)


def test_config_round_trips_through_the_config_keys() -> None:
    config = TrialConfig(4, 2, 3, True)
    data = config.to_config(WORLD)
    assert data["train_batch_size"] == 16
    assert TrialConfig.from_config(data) == config
    assert TrialPins.from_config({"activation_checkpointing": {"enabled": True}}).checkpointing


# -- the memory model ------------------------------------------------------------------------


def test_prediction_is_exact_at_the_profile_and_shards_by_stage() -> None:
    model = MemoryModel(facts())
    assert model.predict(BASELINE) == facts().profile_peak_bytes
    by_stage = [model.predict(TrialConfig(2, 8, stage, False)) for stage in range(4)]
    assert by_stage == sorted(by_stage, reverse=True)  # each stage shards more


def test_one_measurement_fixes_its_family_offset_and_two_fit_the_slope() -> None:
    model = MemoryModel(facts())
    zero3 = TrialConfig(4, 4, 3, False)
    model.observe(zero3, true_peak(zero3))
    assert model.predict(TrialConfig(8, 2, 3, False)) == true_peak(TrialConfig(8, 2, 3, False))


def test_checkpointing_is_bounded_by_the_uncheckpointed_slope_until_measured() -> None:
    model = MemoryModel(facts())
    on, off = TrialConfig(16, 1, 0, True), TrialConfig(16, 1, 0, False)
    assert model.predict(on) == model.predict(off)  # an upper bound, never an underestimate
    model.observe(TrialConfig(4, 4, 0, True), true_peak(TrialConfig(4, 4, 0, True)))
    assert model.predict(on) == pytest.approx(true_peak(on), rel=1e-6)


#: A job whose activations grow 5 % faster in the micro-batch than the 10 MiB a sample its
#: profile measured at one micro-batch (on the grids measured that figure is 3-12 % short).
STEEP = 10.5 * MiB


def steep_peak(config: TrialConfig, per_sample: float = STEEP) -> int:
    """The steep job's real peak: ``true_peak`` along the steeper slope, with a tenth of the
    optimizer state (zero1 then saves about a micro-batch's doubling)."""
    activation = per_sample * (0.3 if config.checkpointing else 1.0)
    job = replace(facts(), optimizer_state_bytes=20 * MiB)
    return round(
        job.state_bytes(config.stage)
        + 5 * MiB
        + activation * config.micro_batch
        - job.unaccumulated_bytes(config)
    )


def steep_facts(per_sample: float = STEEP) -> ModelFacts:
    """What the steep job's profile measured: 10 MiB a sample, at BASELINE's micro-batch."""
    return replace(
        facts(),
        optimizer_state_bytes=20 * MiB,
        profile_peak_bytes=steep_peak(BASELINE, per_sample),
    )


def larger_than_profile(stages: range = range(4)) -> list[TrialConfig]:
    """Every configuration without checkpointing above the profile's micro-batch."""
    return [TrialConfig(m, 16 // m, stage, False) for stage in stages for m in (4, 8, 16)]


def test_a_slope_fitted_at_two_micro_batches_carries_to_the_families_not_fitted() -> None:
    model = MemoryModel(steep_facts())
    # From the profile alone every larger micro-batch is under-predicted.
    assert all(model.predict(c) < steep_peak(c) for c in larger_than_profile())
    model.observe(BASELINE, steep_peak(BASELINE))  # the search records the profile
    model.observe(TrialConfig(4, 4, 0, False), steep_peak(TrialConfig(4, 4, 0, False)))
    # ddp's two micro-batches measured the slope: zero1 (never run) and FSDP's stages, whose
    # slope ddp's bounds, are predicted along it, no longer under their peak.
    for config in larger_than_profile():
        assert model.predict(config) == pytest.approx(steep_peak(config), rel=1e-6), config
    # A family with one measured point goes on from it along the fitted slope.
    zero2 = TrialConfig(2, 8, 2, False)
    model.observe(zero2, steep_peak(zero2) + 3 * MiB)
    assert model.predict(TrialConfig(8, 2, 2, False)) == pytest.approx(
        steep_peak(TrialConfig(8, 2, 2, False)) + 3 * MiB, rel=1e-6
    )


def test_a_fitted_slope_never_predicts_less_than_the_profiles_figure() -> None:
    # A job 5 % shallower than its profile's figure: the fit would predict less, so it is not
    # used (the single point stays the safe side)...
    model = MemoryModel(steep_facts(9.5 * MiB))
    before = {c: model.predict(c) for c in larger_than_profile()}
    model.observe(BASELINE, steep_peak(BASELINE, 9.5 * MiB))
    model.observe(TrialConfig(4, 4, 0, False), steep_peak(TrialConfig(4, 4, 0, False), 9.5 * MiB))
    assert all(model.predict(c) == before[c] for c in larger_than_profile(range(1, 4)))
    # ... and FSDP's slope, even where steeper, bounds FSDP's only (it grows more slowly than
    # ddp's where it differs).
    model = MemoryModel(steep_facts(10 * MiB))
    for micro in (1, 4):
        zero3 = TrialConfig(micro, 16 // micro, 3, False)
        model.observe(zero3, steep_peak(zero3, 11 * MiB))
    whole = larger_than_profile(range(2))
    assert all(model.predict(c) == MemoryModel(steep_facts(10 * MiB)).predict(c) for c in whole)
    zero2 = TrialConfig(8, 2, 2, False)
    assert model.predict(zero2) == pytest.approx(steep_peak(zero2, 11 * MiB), rel=1e-2)


def test_no_larger_micro_batch_is_launched_past_the_slope_a_family_measured() -> None:
    # The profile (ddp 2 x 8) takes 246 MiB; ddp fits 8 x 2 at 309 MiB; zero1 16 x 1 takes
    # 333 MiB, over the cap, though the profile's 10 MiB a sample predicts 326.
    cap = 330 * MiB
    search = TrialSearch(
        TrialSpace(TrialPins(), WORLD, BASELINE), MemoryModel(steep_facts()), cap, 30, THROUGHPUT
    )
    scripted(search, BASELINE, speed(BASELINE), peak=steep_peak(BASELINE), purpose="profile")
    ran = run_search(search, cap, peak_of=steep_peak)
    assert ran[0].config == TrialConfig(8, 2, 0, False)  # ddp's second micro-batch
    assert [r.config.describe() for r in ran if r.outcome != OK] == []


# -- the policy ------------------------------------------------------------------------------


def test_no_trial_is_launched_that_is_predicted_not_to_fit() -> None:
    cap = 460 * MiB
    search = new_search(cap)
    for result in run_search(search, cap):
        assert result.predicted_memory_bytes is not None
        assert result.predicted_memory_bytes <= cap


def test_under_a_cap_sharding_or_checkpointing_reaches_the_best_micro_batch() -> None:
    cap = 420 * MiB  # DDP fits micro-batch 1 only; sharded stages fit up to 16
    search = new_search(cap)
    ran = run_search(search, cap)
    feasible = [
        search.space.config(s, c, m)
        for s in range(4)
        for c in (False, True)
        for m in search.space.micro_batches()
        if true_peak(search.space.config(s, c, m)) <= cap
    ]
    assert search.best() == max(feasible, key=speed)
    assert len(ran) < len(feasible)  # fewer trials than the exhaustive grid


def test_an_out_of_memory_trial_prunes_larger_micro_batches_of_its_family() -> None:
    search = new_search(None)
    search.record(TrialResult(0, TrialConfig(8, 2, 1, False), WORLD, OOM, peak_memory_bytes=None))
    proposal = search._next_in_family(1, False, False)
    assert proposal is not None and proposal.config.micro_batch == 4
    assert "pruned" in search.decisions[-1]


def test_a_crashed_family_is_given_up_and_the_search_goes_on() -> None:
    search = new_search(None, max_trials=10)
    search.record(TrialResult(0, TrialConfig(16, 1, 0, False), WORLD, CRASH, error="boom"))
    proposal = search.next_trial()
    assert proposal is not None and proposal.config.stage == 1


def test_a_diverged_trial_prunes_its_micro_batch_in_every_family_and_steps_down() -> None:
    search = new_search(None, max_trials=10)
    diverged = TrialResult(0, TrialConfig(16, 1, 0, False), WORLD, CRASH, diverged=True)
    search.record(diverged)
    # Not given up as a crash is: the loss diverged at micro-batch 16, so ddp goes on at 8.
    proposal = search.next_trial()
    assert proposal is not None and proposal.config == TrialConfig(8, 2, 0, False)
    assert search.decisions[-1] == (
        "ddp, micro-batch 16 x 1: its parameters went NaN or inf; micro-batches >= 16 pruned "
        "in every strategy of its precision"
    )
    ran = run_search(search, None)
    assert all(r.config.micro_batch < 16 for r in ran)  # no strategy tries 16 again


def test_near_full_steps_down_while_smaller_is_faster() -> None:
    cap = 600 * MiB  # DDP fits 16 at 565 MiB: near full

    def slower_when_full(config: TrialConfig) -> float:
        return speed(config) * (0.7 if true_peak(config) > 0.85 * cap else 1.0)

    search = new_search(cap, pins=TrialPins(stage=0, checkpointing=False))
    ran = run_search(search, cap, slower_when_full)
    assert [r.config.micro_batch for r in ran if r.purpose == "search"] == [16, 8, 4]
    assert search.best() == TrialConfig(8, 2, 0, False)


def scripted(
    search: TrialSearch,
    config: TrialConfig,
    throughput: float,
    peak: int | None = None,
    spread: float = 0.0,
    purpose: str = "search",
) -> None:
    """Tell ``search`` that ``config`` ran ok with these measurements."""
    search.record(
        TrialResult(
            len(search.results),
            config,
            WORLD,
            OK,
            purpose=purpose,
            throughput=throughput,
            throughput_spread=spread,
            step_seconds=config.global_batch(WORLD) / throughput,
            peak_memory_bytes=true_peak(config) if peak is None else peak,
        )
    )


def test_a_step_down_ends_when_faster_only_within_the_trials_spread() -> None:
    cap = 600 * MiB  # DDP fits 16 at 565 MiB: near full
    for below, more in ((52.0, False), (60.0, True)):
        search = new_search(cap, pins=TrialPins(stage=0, checkpointing=False))
        scripted(search, TrialConfig(16, 1, 0, False), 50.0, spread=0.05)
        scripted(search, TrialConfig(8, 2, 0, False), below, spread=0.05)
        proposal = search.next_trial()
        # 4 % faster with 5 % spread says nothing; 20 % faster goes on down.
        stepped = proposal is not None and proposal.config == TrialConfig(4, 4, 0, False)
        assert stepped is more


def test_a_step_down_that_a_cheaper_strategy_already_measured_is_not_run() -> None:
    cap = 400 * MiB  # zero1 is predicted to fit micro-batch 8 at most (385 MiB: near full)
    for ddp_at_4, said in ((50.0, "was slower"), (70.0, "bounds it and was measured")):
        search = new_search(cap, pins=TrialPins(checkpointing=False))
        scripted(search, TrialConfig(4, 4, 0, False), ddp_at_4, peak=300 * MiB)
        scripted(search, TrialConfig(8, 2, 1, False), 60.0)
        # zero1 4 x 4 is no faster than the measured ddp 4 x 4: it cannot win, slower or not.
        assert search._next_in_family(1, False, False) is None
        expected = f"zero1, micro-batch 8 x 2: not stepped down, ddp, micro-batch 4 x 4 {said}"
        assert expected in search.decisions
    # Where no cheaper strategy ran micro-batch 4, the near-full zero1 8 x 2 steps down.
    search = new_search(cap, pins=TrialPins(checkpointing=False))
    scripted(search, TrialConfig(2, 8, 0, False), 50.0, peak=300 * MiB)
    scripted(search, TrialConfig(8, 2, 1, False), 60.0)
    proposal = search._next_in_family(1, False, False)
    assert proposal is not None and proposal.config == TrialConfig(4, 4, 1, False)


def test_a_trial_no_fuller_than_one_the_cap_did_not_slow_is_not_stepped_down() -> None:
    cap = 400 * MiB  # zero1 is predicted to fit micro-batch 8 at most (385 MiB: 96 % full)
    for ddp_peak, stepped in ((395 * MiB, False), (380 * MiB, True)):
        search = new_search(cap, pins=TrialPins(checkpointing=False))
        # ddp 2 x 8 ran near the cap, and its step down 1 x 16 was not faster: the cap's
        # pressure did not slow it.
        scripted(search, TrialConfig(2, 8, 0, False), 75.0, peak=ddp_peak, spread=0.05)
        scripted(search, TrialConfig(1, 16, 0, False), 74.0, peak=300 * MiB, spread=0.05)
        scripted(search, TrialConfig(8, 2, 1, False), 70.0)
        proposal = search._next_in_family(1, False, False)
        # Not stepped down below ddp's 99 %; stepped down where ddp ran at 95 % only.
        assert (proposal is not None and proposal.config == TrialConfig(4, 4, 1, False)) is stepped
        said = "was not faster than the fuller ddp, micro-batch 2 x 8"
        assert any(said in d for d in search.decisions) is not stepped


def test_where_every_cheaper_strategy_ran_near_full_the_next_gets_one_trial_there() -> None:
    # 400 MiB: DDP fits nothing, zero1 micro-batch 8 (near full), zero2 16 at 365 MiB (near
    # full), zero3 fits 16 at most (285 MiB): no larger micro-batch than zero2 reached.
    cap = 400 * MiB
    pins = TrialPins(checkpointing=False)

    def zero3_runs(search: TrialSearch) -> list[TrialConfig]:
        return [r.config for r in search.results if r.config.stage == 3]

    # Sharding only costs here: zero3 gets its one trial, is slower, and is given up.
    search = new_search(cap, pins=pins)
    run_search(search, cap)
    assert zero3_runs(search) == [TrialConfig(16, 1, 3, False)]
    assert any(d.startswith("zero3: one trial at micro-batch 16") for d in search.decisions)
    assert any(d.startswith("zero3: given up, not faster") for d in search.decisions)

    # The cap slows near-full configurations: zero3's room makes it faster, and it is kept.
    def slower_when_full(config: TrialConfig) -> float:
        return speed(config) * (0.7 if true_peak(config) > 0.85 * cap else 1.0)

    search = new_search(cap, pins=pins)
    run_search(search, cap, slower_when_full)
    assert TrialConfig(16, 1, 3, False) in zero3_runs(search)
    assert not any(d.startswith("zero3: given up") for d in search.decisions)
    ranked = [config for config, _ in search.ranking()]
    assert ranked.index(TrialConfig(16, 1, 3, False)) < ranked.index(TrialConfig(16, 1, 2, False))


def test_the_caps_effect_at_a_micro_batch_is_tested_once() -> None:
    # 430 MiB: zero1 reaches 16 near full (415 MiB); zero2 and zero3 fit no more than 16.
    cap = 430 * MiB
    search = new_search(cap, pins=TrialPins(checkpointing=False))
    run_search(search, cap)
    searched = [r for r in search.results if r.purpose == "search"]
    assert [r.config for r in searched if r.config.stage == 2] == [TrialConfig(16, 1, 2, False)]
    assert not [r for r in search.results if r.config.stage == 3]
    assert any(d.startswith("zero3: skipped") for d in search.decisions)


def test_a_stage_whose_room_ran_out_of_memory_is_held_to_the_same_test() -> None:
    cap = 400 * MiB
    search = new_search(cap, pins=TrialPins(checkpointing=False))
    scripted(search, TrialConfig(8, 2, 1, False), 60.0, peak=300 * MiB)  # with room
    # zero2 is predicted to fit 16, above zero1's 8: it may make room, and is tried there.
    proposal = search._next_in_family(2, False, False)
    assert proposal is not None and proposal.config == TrialConfig(16, 1, 2, False)
    search.record(TrialResult(len(search.results), proposal.config, WORLD, OOM))
    # It ran out of memory: what it still fits, 8, zero1 already ran with room, and at one
    # micro-batch more sharding only adds work.
    assert search._next_in_family(2, False, False) is None
    skipped = "zero2: skipped, it fits micro-batch 8 at most and a cheaper strategy reached 8"
    assert skipped in search.decisions


def test_no_trial_relieves_a_near_full_trial_whose_step_down_with_room_was_not_faster() -> None:
    cap = 400 * MiB  # zero2 fits 16 near the cap (365 MiB), zero3 fits 16 at most
    cases = [
        (300 * MiB, 69.0, False),  # the step down had room and was not faster: no relief
        (350 * MiB, 69.0, True),  # the step down was near the cap too: it answers nothing
        (300 * MiB, 80.0, True),  # the step down with room was faster: the cap may hurt
    ]
    for below_peak, below_value, relieved in cases:
        search = new_search(cap, pins=TrialPins(checkpointing=False))
        scripted(search, TrialConfig(16, 1, 2, False), 70.0, peak=365 * MiB, spread=0.02)
        scripted(search, TrialConfig(8, 2, 2, False), below_value, peak=below_peak, spread=0.02)
        proposal = search._next_in_family(3, False, False)
        if relieved:
            assert proposal is not None and proposal.config == TrialConfig(16, 1, 3, False)
            continue
        assert proposal is None
        said = (
            "zero3: no trial at micro-batch 16, zero2, micro-batch 16 x 1 ran near the cap but "
            "zero2, micro-batch 8 x 2, with room, was not faster"
        )
        assert said in search.decisions


def test_re_measuring_stops_after_the_best_two_when_a_drift_reorders_them() -> None:
    search = new_search(None, pins=TrialPins(stage=0, checkpointing=False), max_trials=10)
    for micro, value in ((16, 100.0), (8, 90.0), (4, 80.0)):
        scripted(search, TrialConfig(micro, 16 // micro, 0, False), value)
    remeasured = []
    while (proposal := search.next_trial()) is not None:
        assert proposal.purpose == "remeasure"
        remeasured.append(proposal.config.micro_batch)
        # The machine got busier: every second measurement is lower.
        scripted(search, proposal.config, 60.0, purpose="remeasure")
    assert remeasured == [16, 8]  # 4 x 4 now ranks first on one measurement: not chased


def test_the_best_two_are_compared_within_pairs_under_drift() -> None:
    search = new_search(None, pins=TrialPins(stage=0, checkpointing=False), max_trials=6)
    for micro, value in ((16, 100.0), (8, 95.0), (4, 90.0)):
        scripted(search, TrialConfig(micro, 32 // (2 * micro), 0, False), value)
    # The load rose: both re-measures fell, and 8 x 2 is the faster of the two under it.
    again = {16: 65.0, 8: 70.0}
    while (proposal := search.next_trial()) is not None:
        scripted(search, proposal.config, again[proposal.config.micro_batch], purpose="remeasure")
    assert [r.config.micro_batch for r in search.results if r.purpose == "remeasure"] == [16, 8]
    # Not 4 x 4 on its one measurement (90 against means of 82.5), and within pairs 8 x 2:
    # 95 / 100 x 70 / 65 > 1.
    assert search.best() == TrialConfig(8, 2, 0, False)
    assert search.decisions[-1].startswith("ddp, micro-batch 8 x 2: chosen within pairs")
    # A re-measure that did not run ok leaves the choice to the means: 16 x 1's 82.5 is below
    # 4 x 4's 90, and 8 x 2's crashed re-measure leaves it its 95.
    search.results[-1] = replace(search.results[-1], outcome=CRASH, throughput=None)
    assert search.best() == search.ranking()[0][0] == TrialConfig(8, 2, 0, False)
    search.results[-2] = replace(search.results[-2], throughput=99.0)  # 16 x 1: mean 99.5
    assert search.best() == TrialConfig(16, 1, 0, False)


def test_the_next_is_not_measured_again_where_the_best_leads_by_more_than_the_noise() -> None:
    for again, more in ((98.0, False), (85.0, True)):
        search = new_search(None, pins=TrialPins(stage=0, checkpointing=False), max_trials=10)
        for micro, value in ((16, 100.0), (8, 90.0), (4, 80.0)):
            scripted(search, TrialConfig(micro, 16 // micro, 0, False), value, spread=0.01)
        proposal = search.next_trial()
        assert proposal is not None and proposal.purpose == "remeasure"
        assert proposal.config == TrialConfig(16, 1, 0, False)  # the best first
        scripted(search, proposal.config, again, spread=0.01, purpose="remeasure")
        proposal = search.next_trial()
        if more:
            # Two runs of 16 x 1 landed 16 % apart: its mean 92.5 leads 8 x 2's one run of 90
            # by less than that, so 8 x 2 is measured again and the two compared within pairs.
            assert proposal is not None and proposal.config == TrialConfig(8, 2, 0, False)
            assert search.run_noise() == pytest.approx(15 / 92.5)
            continue
        # Two runs 2 % apart: a mean of 99 leads 90 by 10 %, five times the noise (more than
        # the 2.67 times a tie allows); the second re-measure could not change the choice.
        assert proposal is None
        assert search.run_noise() == pytest.approx(2 / 99)
        assert search.best() == TrialConfig(16, 1, 0, False)
        said = "ddp, micro-batch 16 x 1: chosen, measured twice (100, 98) and ahead of ddp, "
        assert search.decisions[-1].startswith(said)


def test_the_noise_between_two_runs_counts_where_it_exceeds_the_trials_spread() -> None:
    search = new_search(None, pins=TrialPins(stage=0, checkpointing=False), max_trials=10)
    assert search.run_noise() is None
    scripted(search, TrialConfig(16, 1, 0, False), 100.0, spread=0.03)
    scripted(search, TrialConfig(8, 2, 0, False), 94.0, spread=0.03)
    # One run each: only the trials' own spread says what a difference is worth.
    assert search.noise(search.results) == pytest.approx(0.03)
    assert search.clearly_better(search.results[0], search.results[1])
    scripted(search, TrialConfig(16, 1, 0, False), 90.0, spread=0.03, purpose="remeasure")
    # 16 x 1's two runs landed 10.5 % apart, three times its steps' spread: 6 % says nothing.
    assert search.noise(search.results) == pytest.approx(10 / 95)
    assert not search.clearly_better(search.results[0], search.results[1])


def test_pins_are_never_changed_and_the_global_batch_is_fixed() -> None:
    pins = TrialPins(stage=1, checkpointing=True)
    search = new_search(None, pins=pins)
    ran = run_search(search, None)
    assert ran
    assert {(r.config.stage, r.config.checkpointing) for r in ran} == {(1, True)}
    assert {r.config.global_batch(WORLD) for r in ran} == {32}


def test_the_best_two_are_measured_again_within_the_budget() -> None:
    cap = 420 * MiB  # DDP fits micro-batch 1 only: the sharded stages are worth trying
    search = new_search(cap, max_trials=4)  # fewer than the search would run
    runs: dict[TrialConfig, int] = {}

    def drifting(config: TrialConfig) -> float:
        # Each run of a configuration a quarter below the one before: two runs far apart.
        runs[config] = runs.get(config, 0) + 1
        return speed(config) * 0.75 ** (runs[config] - 1)

    ran = run_search(search, cap, drifting)
    assert len(ran) == 4
    remeasured = [r.config for r in ran if r.purpose == "remeasure"]
    assert len(remeasured) == 2
    assert {c for c, _ in search.ranking()[:2]} <= {r.config for r in ran}


def test_the_only_configuration_that_ran_ok_is_not_measured_again() -> None:
    # Every trial after the profile fails (a script that runs out of memory above its own
    # micro-batch, whatever the cap says): re-measuring the profile could choose nothing else,
    # so the budget goes to search trials, and the search then ends without a re-measure.
    cap = 1000 * MiB
    for budget in (3, 30):
        search = new_search(cap, max_trials=budget)
        scripted(search, BASELINE, speed(BASELINE), purpose="profile")
        ran = run_search(search, cap, peak_of=lambda c: true_peak(c) + (c != BASELINE) * cap)
        assert ran and all(r.purpose == "search" and r.outcome == OOM for r in ran)
        # A budget of 3: two search trials (before, one and a re-measure of the profile); of 30:
        # the search runs out of trials to try first.
        assert len(ran) == 2 if budget == 3 else len(ran) < budget - 1
        assert search.best() == BASELINE
    assert search.decisions[-1] == (
        "ddp, micro-batch 2 x 8: the only configuration that ran ok; not measured again (a "
        "re-measure could choose nothing else)"
    )


def test_latency_is_minimised() -> None:
    # Throughput and step time disagree only when the global batch changes.
    search = new_search(None, max_trials=12, metric=LATENCY, allow_batch_change=True)
    run_search(search, None)
    ok = [r for r in search.results if r.outcome == OK]
    fastest_step = min(ok, key=lambda r: r.step_seconds)  # type: ignore[arg-type, return-value]
    most_samples = max(ok, key=lambda r: r.throughput)  # type: ignore[arg-type, return-value]
    assert search.best() == fastest_step.config == TrialConfig(1, 8, 0, False)
    assert most_samples.config != fastest_step.config


def test_a_profile_below_the_largest_fitting_micro_batch_does_not_stop_its_family() -> None:
    search = new_search(None)
    profile = BASELINE
    search.record(
        TrialResult(
            0,
            profile,
            WORLD,
            OK,
            purpose="profile",
            throughput=speed(profile),
            step_seconds=32 / speed(profile),
            peak_memory_bytes=true_peak(profile),
        )
    )
    proposal = search.next_trial()
    assert proposal is not None and proposal.config == TrialConfig(16, 1, 0, False)


def test_the_profiles_checkpointed_estimate_is_the_prior_of_checkpointed_families() -> None:
    measured = replace(facts(), checkpointed_bytes_per_sample=3 * MiB)
    model = MemoryModel(measured)
    on = TrialConfig(16, 1, 0, True)
    expected = (
        measured.state_bytes(0)
        + measured.residual_bytes
        + 48 * MiB
        # No accumulation: half the gradients never coexist with the activations, less as
        # checkpointing keeps 3 of the 10 MiB a sample for them to overlap.
        - measured.gradient_bytes / 2 * 0.3
    )
    assert model.predict(on) == round(expected)


def test_without_accumulation_the_gradients_overlap_the_activations_in_part() -> None:
    model = MemoryModel(facts())
    g = facts().gradient_bytes
    for stage, share in ((0, 0.5), (1, 0.5), (2, 0.5), (3, 1.0)):
        single, accumulating = TrialConfig(16, 1, stage, False), TrialConfig(8, 2, stage, False)
        # Along the activation line from 8 x 2, less the share of G that 16 x 1 does not hold.
        line = model.predict(accumulating) + 8 * facts().activation_bytes_per_sample
        assert model.predict(single) == round(line - share * g)
    # A profile without accumulation: its residual gets the share back, so it is predicted as
    # measured, and an accumulating configuration gets the share on top.
    profile = TrialConfig(16, 1, 0, False)
    unaccumulated = replace(facts(), profile=profile, profile_peak_bytes=500 * MiB)
    model = MemoryModel(unaccumulated)
    assert model.predict(profile) == 500 * MiB
    assert model.predict(TrialConfig(8, 2, 0, False)) == round(500 * MiB - 80 * MiB + g / 2)


def peak_with_share(config: TrialConfig, shares: dict[int, float]) -> int:
    """A job whose configurations without accumulation hold ``1 - shares[stage]`` of the
    gradients at their peak (``true_peak`` otherwise)."""
    if config.accumulation > 1 or config.stage not in shares:
        return true_peak(config)
    prior = facts().unaccumulated_bytes(config)
    return round(true_peak(config) + prior - shares[config.stage] * facts().gradient_bytes)


def test_a_trial_without_accumulation_teaches_its_class_the_share_of_the_gradients() -> None:
    model = MemoryModel(facts())
    zero1, zero2 = TrialConfig(16, 1, 1, False), TrialConfig(16, 1, 2, False)
    shares = {1: 0.9, 2: 0.9}
    assert model.predict(zero1) == true_peak(zero1)  # the prior: half of G off
    model.observe(zero2, peak_with_share(zero2, shares))
    # zero2's trial measured 0.9 of G off: zero1 (same class, never run) is predicted with it.
    assert model.predict(zero1) == pytest.approx(peak_with_share(zero1, shares), rel=1e-6)
    # Not for zero3, not for a smaller micro-batch (fewer activations), and not with
    # accumulation; checkpointing (without the profile's checkpointed figure) see below.
    for other in (
        TrialConfig(16, 1, 3, False),
        TrialConfig(8, 1, 1, False),
        TrialConfig(8, 2, 1, False),
    ):
        assert model.predict(other) == MemoryModel(facts()).predict(other)


def checkpointed_peak(config: TrialConfig, share: float) -> int:
    """A job whose checkpointed configurations keep 3 of the 10 MiB a sample and, without
    accumulation, do not hold ``share`` of the gradients at their peak."""
    kept = 3 * MiB if config.checkpointing else 10 * MiB
    held = 0.0 if config.accumulation > 1 else share * facts().gradient_bytes
    return round(facts().state_bytes(config.stage) + 5 * MiB + kept * config.micro_batch - held)


def test_checkpointing_scales_the_share_until_its_class_measured_one() -> None:
    measured = replace(facts(), checkpointed_bytes_per_sample=3 * MiB)
    model = MemoryModel(measured)
    zero1, ddp_on = TrialConfig(16, 1, 1, False), TrialConfig(16, 1, 0, True)
    # Without checkpointing the share is 0.9; with it the gradients overlap 3/10 of the
    # activations, and its trials measure 0.3: the prior G / 2 would predict 20 MiB short.
    model.observe(zero1, checkpointed_peak(zero1, 0.9))
    assert model.predict(ddp_on) == pytest.approx(checkpointed_peak(ddp_on, 0.27), rel=1e-6)
    assert model.predict(ddp_on) >= checkpointed_peak(ddp_on, 0.3)
    # Once a checkpointed trial measured its own share, the class predicts with it.
    zero1_on = TrialConfig(16, 1, 1, True)
    model.observe(zero1_on, checkpointed_peak(zero1_on, 0.3))
    assert model.predict(ddp_on) == pytest.approx(checkpointed_peak(ddp_on, 0.3), rel=1e-6)
    # zero3's share is FSDP's resharding, not an overlap: checkpointing does not scale it.
    zero3_on = TrialConfig(16, 1, 3, True)
    assert MemoryModel(measured).share(zero3_on) == 1.0


def test_no_checkpointed_trial_is_launched_on_the_uncheckpointed_share() -> None:
    cap = 420 * MiB  # checkpointed ddp 16 x 1: 423 MiB true, 403 MiB on the prior G / 2
    search = TrialSearch(
        TrialSpace(TrialPins(stage=0), WORLD, BASELINE),
        MemoryModel(replace(facts(), checkpointed_bytes_per_sample=3 * MiB)),
        cap,
        30,
        THROUGHPUT,
    )
    ran = run_search(search, cap, peak_of=lambda c: checkpointed_peak(c, 0.3))
    assert OOM not in [r.outcome for r in ran]
    assert search.best() is not None


def test_the_smallest_share_measured_in_a_class_is_the_one_predicted() -> None:
    model = MemoryModel(facts())
    ddp, zero1, zero2 = (TrialConfig(16, 1, s, False) for s in (0, 1, 2))
    shares = {0: 0.3, 1: 0.6, 2: 0.9}
    model.observe(zero2, peak_with_share(zero2, shares))
    model.observe(ddp, peak_with_share(ddp, shares))
    # zero1 gets ddp's 0.3, the conservative one (its own 0.6 is unknown until it runs).
    assert model.predict(zero1) == pytest.approx(peak_with_share(zero1, {1: 0.3}), rel=1e-6)
    assert model.predict(zero1) > peak_with_share(zero1, shares)


def test_a_trial_without_accumulation_never_lowers_its_family_with_accumulation() -> None:
    model = MemoryModel(facts())
    single, accumulating = TrialConfig(16, 1, 2, False), TrialConfig(8, 2, 2, False)
    before = model.predict(accumulating)
    # 1.5 x G under the prior's line: more than the gradients, so the formula is off there, and
    # nothing says the same holds for a configuration that accumulates.
    model.observe(single, true_peak(single) - 100 * MiB)
    assert model.predict(accumulating) == before
    # Above the line it does count (an underestimate is corrected upwards).
    model = MemoryModel(facts())
    model.observe(single, true_peak(single) + 20 * MiB)
    assert model.predict(accumulating) == before + 20 * MiB


def test_a_learned_share_reaches_the_best_micro_batch_and_an_oom_still_prunes() -> None:
    cap = 380 * MiB  # zero1 16 x 1: 415 MiB under the prior, 375 MiB with zero2's share
    search = new_search(cap)
    ran = run_search(search, cap, peak_of=lambda c: peak_with_share(c, {1: 0.9, 2: 0.9}))
    zero1 = TrialConfig(16, 1, 1, False)
    assert [r.outcome for r in ran if r.config == zero1][:1] == [OK]
    assert all(r.predicted_memory_bytes <= cap for r in ran if r.predicted_memory_bytes)
    # A class whose other stage holds more of its gradients: zero1 16 x 1 is launched on
    # zero2's share, runs out of memory, is pruned and never launched again.
    search = new_search(cap)
    ran = run_search(search, cap, peak_of=lambda c: peak_with_share(c, {1: 0.5, 2: 0.9}))
    assert [r.outcome for r in ran if r.config == zero1] == [OOM]
    assert search.best() is not None


def test_a_trial_record_round_trips_through_trials_jsonl() -> None:
    result = TrialResult(
        3,
        TrialConfig(4, 4, 2, True),
        WORLD,
        OK,
        purpose="remeasure",
        throughput=12.5,
        throughput_spread=0.1,
        step_seconds=2.56,
        peak_memory_bytes=10,
        predicted_memory_bytes=11,
        duration=1.5,
        log_path="/r/log.txt",
        steps=7,
    )
    assert TrialResult.from_json(json.loads(json.dumps(result.to_json()))) == result
    crashed = TrialResult(4, TrialConfig(8, 2, 0, False), WORLD, CRASH, diverged=True)
    assert TrialResult.from_json(json.loads(json.dumps(crashed.to_json()))) == crashed


def test_a_record_written_before_steps_were_recorded_reads_as_steps_unknown() -> None:
    # A trials.jsonl of an earlier version, as --autotune_resume reads it.
    record = TrialResult(0, TrialConfig(2, 4, 0, False), WORLD, "invalid", "profile").to_json()
    del record["steps"]
    assert TrialResult.from_json(record).steps is None


def test_a_stage_that_fits_no_larger_micro_batch_than_a_cheaper_one_is_skipped() -> None:
    search = new_search(None)  # no cap: DDP fits the largest micro-batch
    ran = run_search(search, None)
    assert {r.config.stage for r in ran} == {0}
    assert any("zero1: skipped" in d for d in search.decisions)


def bounded_search(cap: int) -> TrialSearch:
    """Activations of 40 MiB a sample, checkpointed 12: under ``cap`` DDP fits micro-batch 4
    well below the cap, ZeRO-1 fits 8, and checkpointed DDP 16."""
    space = TrialSpace(TrialPins(), WORLD, BASELINE)
    model = MemoryModel(replace(facts(40 * MiB), checkpointed_bytes_per_sample=12 * MiB))
    return TrialSearch(space, model, cap, 30, THROUGHPUT)


def test_nothing_that_cannot_beat_the_best_measured_is_run() -> None:
    cap = 700 * MiB
    for spread, runs_more in ((0.01, False), (0.05, True)):
        search = bounded_search(cap)
        # The script's own 2 x 8 and DDP's largest fitting micro-batch, both well below the
        # cap: the larger micro-batch saved nothing.
        scripted(search, BASELINE, 100.0, peak=485 * MiB, spread=spread)
        proposal = search.next_trial()
        assert proposal is not None and proposal.config == TrialConfig(4, 4, 0, False)
        scripted(search, proposal.config, 98.0, peak=565 * MiB, spread=spread)
        # ZeRO-1 at 8 and checkpointed DDP at 16 need no less work than DDP at 4 and can save
        # no more per doubling than 2 -> 4 did (nothing): they can reach 98 at most, 2 % below
        # the best measured. Within a 5 % spread that proves nothing, and they run.
        proposal = search.next_trial()
        assert proposal is not None
        if runs_more:
            assert proposal.config == TrialConfig(8, 2, 1, False)
            continue
        assert proposal.purpose == "remeasure"
        said = "zero1, micro-batch 8 x 2: not run, it can reach 98 at most (from ddp, micro-batch"
        assert any(d.startswith(said) for d in search.decisions)
        assert any(
            d.startswith("ddp, micro-batch 16 x 1, checkpointing: not run")
            for d in search.decisions
        )


def test_a_bound_extrapolates_the_saving_per_doubling_and_ignores_trials_near_the_cap() -> None:
    cap = 700 * MiB
    search = bounded_search(cap)
    scripted(search, BASELINE, 100.0, peak=485 * MiB)  # 0.32 s a step
    scripted(search, TrialConfig(4, 4, 0, False), 128.0, peak=565 * MiB)  # 0.25 s: -0.07
    scripted(search, TrialConfig(8, 2, 1, False), 80.0, peak=590 * MiB)  # 0.4 s
    # ZeRO-2 at 16: ZeRO-1's 0.4 s at 8 less one doubling's 0.07 s at most.
    bound = search.bound(TrialConfig(16, 1, 2, False))
    assert bound is not None and bound.anchor.config == TrialConfig(8, 2, 1, False)
    assert bound.value == pytest.approx(32 / 0.33)
    # Checkpointed DDP at 16 from DDP's 0.25 s at 4, two doublings: 0.11 s, 291 samples/s.
    bound = search.bound(TrialConfig(16, 1, 0, True))
    assert bound is not None and bound.value == pytest.approx(32 / 0.11)
    # A trial near the cap may have been slowed by it: it bounds nothing.
    search = bounded_search(cap)
    scripted(search, BASELINE, 100.0, peak=485 * MiB)
    scripted(search, TrialConfig(4, 4, 0, False), 98.0, peak=650 * MiB)
    assert search.bound(TrialConfig(8, 2, 1, False)) is None


# -- mixed precision -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "pinned"),
    [
        ({}, False),  # absent: never (it changes the numerics)
        ({"bf16": {"enabled": False}}, False),
        ({"bf16": {"enabled": True}}, True),
        ({"bf16": {"enabled": "auto"}}, None),
        ({"bf16": "auto"}, None),
    ],
)
def test_bf16_is_allowed_only_where_the_config_says_so(config, pinned) -> None:
    assert TrialPins.from_config(config).bf16 is pinned


def test_a_bad_bf16_section_names_what_is_allowed() -> None:
    with pytest.raises(TrialConfigError, match="bf16 must be a mapping with enabled: true"):
        TrialPins.from_config({"bf16": {"enabled": "maybe"}})


def bf16_speed(config: TrialConfig) -> float:
    return speed(config) * (1.3 if config.bf16 else 1.0)


@pytest.mark.parametrize("bf16", [False, True])
def test_a_pinned_or_absent_bf16_is_never_changed(bf16) -> None:
    search = new_search(700 * MiB, TrialPins(bf16=bf16))
    ran = run_search(search, 700 * MiB, bf16_speed)
    assert {r.config.bf16 for r in ran} == {bf16}
    assert search.best().bf16 is bf16


def test_with_bf16_allowed_the_search_tries_it_as_a_family_and_keeps_it_if_faster() -> None:
    search = new_search(700 * MiB, TrialPins(bf16=None))
    ran = run_search(search, 700 * MiB, bf16_speed)
    tried = [(r.config.stage, r.config.bf16) for r in ran if r.purpose == "search"]
    # DDP in full precision first, then its bf16 twin (predicted as the twin until measured).
    assert tried[:2] == [(0, False), (0, True)]
    best = search.best()
    assert best is not None and best.bf16
    assert best.to_config(WORLD)["bf16"] == {"enabled": True}
    assert TrialConfig.from_config(best.to_config(WORLD)) == best
    # Slower in full precision: kept off.
    search = new_search(700 * MiB, TrialPins(bf16=None))
    run_search(search, 700 * MiB, lambda c: speed(c) * (0.7 if c.bf16 else 1.0))
    assert not search.best().bf16
