"""Tuner quality on synthetic and measured landscapes; no torch, no processes.

    .venv/bin/python -m benchmarks.tuner_quality --draw held-out --seeds 20 --jobs 2 \
        --sweep --only "distune,random,grid,bagua,horovod,whole range" \
        --plot docs/images/bench_tuner_random_draw.png            # the issue-14 table
    .venv/bin/python -m benchmarks.tuner_quality --draw training --quick   # while iterating
    .venv/bin/python -m benchmarks.tuner_quality --draw training --quick --sweep \
        --only "distune,whole range,<=2^6 buckets"              # settings, training draw only
    .venv/bin/python -m benchmarks.tuner_quality --jobs 2 --plot docs/images/bench_tuner_quality.png
    .venv/bin/python -m benchmarks.tuner_quality --sweep   # and variants of the settings
    .venv/bin/python -m benchmarks.tuner_quality --sweep --only distune,acq=PI  # one variant
    .venv/bin/python -m benchmarks.tuner_quality --seeds 20 --jobs 2 --json out.json

Every tuner runs at every budget of ``--budgets`` (the table shows ``--checkpoints``); the
Bagua-style tuner's Gaussian-process fits make it the slow one (about 8 s a run).

``--sweep`` is how the shipped optimizer settings were chosen: each variant changes one setting
of the shipped configuration (docs/tuning_service.md has the figures and the reasoning).
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import sys
import time
from pathlib import Path

from benchmarks.tuner_quality.compare import (
    SHORTFALL_BARS,
    Run,
    compare,
    coverage_table,
    gain_claim_table,
    load_runs,
    per_landscape_table,
    percentile_plot,
    percentile_table,
    plot,
    save_runs,
    shortfall_table,
    summary_table,
    tuning_time_table,
)
from benchmarks.tuner_quality.landscapes import Landscape, standard_suite
from benchmarks.tuner_quality.measurement import NoiseModel
from benchmarks.tuner_quality.random_clusters import (
    DRAW_SEEDS,
    draw,
    optimum_position,
)
from benchmarks.tuner_quality.tuners import (
    BaguaStyle,
    DistuneTuner,
    GridSearch,
    HorovodStyle,
    ProvingOracle,
    RandomSearch,
    Tuner,
)
from distune.tuning_service.config import OptimizerSettings, TuningConfig

#: The random draws' noise: 4.5% per window, 1% per period, rare stalls.
DRAW_NOISE = NoiseModel(window_sigma=0.045, period_sigma=0.01, stall_rate=0.01, lucky_rate=0.005)
#: Budgets of the random-draw table (the issue's).
DRAW_BUDGETS = "5,8,12,20,40"


def _variant(name: str, optimizer: dict | None = None, **config: object) -> DistuneTuner:
    shipped = TuningConfig()
    settings = dataclasses.replace(shipped.optimizer, **(optimizer or {}))
    return DistuneTuner(name, dataclasses.replace(shipped, optimizer=settings, **config))


def sweep() -> list[Tuner]:
    """Variants of the shipped settings, one change each."""
    shipped = OptimizerSettings()
    return [
        _variant("init=lhs", {"initial_design": "lhs"}),
        _variant(f"init_points={shipped.initial_points - 1}", {"initial_points": 3}),
        _variant(f"init_points={shipped.initial_points + 2}", {"initial_points": 6}),
        _variant("acq=PI", {"acquisition": "PI"}),
        _variant("acq=LCB", {"acquisition": "LCB"}),
        _variant("noise=none", {"noise": "none"}),
        _variant("no early stop", {"stop_improvement": 0.0}),
        _variant("stop_min_groups=5", {"stop_min_groups": 5}),
        _variant("stop_min_share=0.3", {"stop_min_share": 0.3}),
        _variant("stop floor 5 / 0.3", {"stop_min_groups": 5, "stop_min_share": 0.3}),
        _variant("no confirmation", confirm_top=0),
        _variant("confirm_top=3", confirm_top=3),
        _variant("confirm_margin=0.05", confirm_margin=0.05),
        _variant("whole range", {"max_buckets_2p": None}),
        _variant("<=2^12 buckets", {"max_buckets_2p": 12}),
        _variant("<=2^6 buckets", {"max_buckets_2p": 6}),
        _variant("not cost-aware", {"cost_aware": False}),
        _variant("no early end", early_end_windows=0),
        _variant("gain_confidence=0.9", gain_confidence=0.90),
        _variant("close_call_time=20", close_call_time=20.0),
        _variant("close_call_time=40", close_call_time=40.0),
        _variant("max_windows=256", max_windows=256),
        _variant("no proven fallback", proven_fallback=False),
        _variant("no settling", settle_runners_up=False),
        _variant("neither", proven_fallback=False, settle_runners_up=False),
    ]


def _tuners(args: argparse.Namespace) -> list[Tuner]:
    """The tuners the command line asks for."""
    tuners: list[Tuner] = [
        DistuneTuner(),
        RandomSearch(),
        GridSearch(),
        BaguaStyle(acquisition_points=300 if args.draw else 1000),
        HorovodStyle(),
        ProvingOracle(),
    ]
    if args.sweep:
        tuners += sweep()
    if args.only:
        wanted = set(args.only.split(","))
        tuners = [t for t in tuners if t.name in wanted]
    return tuners


def _landscapes(args: argparse.Namespace) -> tuple[list[Landscape], NoiseModel]:
    """The landscapes the command line asks for, and the noise they are measured with."""
    if args.draw:
        landscapes = draw(DRAW_SEEDS[args.draw], args.count)
        noise = DRAW_NOISE
    else:
        landscapes = standard_suite()
        noise = NoiseModel()
    if args.landscapes:
        landscapes = [ls for ls in landscapes if args.landscapes in ls.name]
    return landscapes, noise


def _seeds_per_tuner(runs: list[Run]) -> str:
    """How many seeds each tuner ran, e.g. "20 seeds (bagua 5)"."""
    counts: dict[str, set[int]] = {}
    for run in runs:
        counts.setdefault(run.tuner, set()).add(run.seed)
    common = max(len(seeds) for seeds in counts.values())
    fewer = [f"{tuner} {len(seeds)}" for tuner, seeds in counts.items() if len(seeds) != common]
    return f"{common} seeds" + (f" ({', '.join(fewer)})" if fewer else "")


def _saved_runs(
    parser: argparse.ArgumentParser, paths: list[str], checkpoints: list[int]
) -> list[Run]:
    """The runs saved in ``paths``; a usage error if one lacks a budget of ``checkpoints``."""
    runs = load_runs(paths)
    for run in runs:
        absent = [k for k in checkpoints if k not in run.budgets]
        if absent:
            parser.error(
                f"--checkpoints {','.join(map(str, checkpoints))}: the saved runs of "
                f"{run.tuner!r} on {run.landscape!r} have no budget {absent} (they were run at "
                f"budgets {list(run.budgets)}); give --checkpoints (and --budgets) among those "
                "every saved run has"
            )
    return runs


def _print_tuning_time(runs: list[Run], checkpoints: list[int]) -> None:
    """The tuning time table, if the runs recorded their time."""
    sample_seconds = TuningConfig().sampling_confidence_time
    times = tuning_time_table(runs, checkpoints, sample_seconds)
    if times:
        print(
            "\nTuning time (job seconds from warmup's end to completion) over the budget x "
            f"the sampling time ({sample_seconds:g} s):\n"
        )
        print(times)


def main(argv: list[str] | None = None) -> int:
    """Run the comparison and print markdown tables (and JSON with --json)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tuner_quality")
    parser.add_argument("--seeds", type=int, default=20, help="seeds per landscape (default 20)")
    parser.add_argument(
        "--first-seed",
        type=int,
        default=0,
        help="the first seed (default 0): a long run split into chunks, each saved with "
        "--json and joined with --runs",
    )
    parser.add_argument(
        "--budgets", default="3,5,7,10,15,20,30,40", help="budgets (samples) every tuner runs at"
    )
    parser.add_argument("--checkpoints", default="5,10,20,40", help="budgets the table shows")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes (default 1)")
    parser.add_argument("--sweep", action="store_true", help="also run variants of the settings")
    parser.add_argument(
        "--only",
        help="comma-separated names of the tuners to run (with --sweep, of its variants too)",
    )
    parser.add_argument("--landscapes", help="only landscapes whose name contains this")
    parser.add_argument(
        "--draw",
        choices=tuple(DRAW_SEEDS),
        help="random clusters (benchmarks/tuner_quality/random_clusters.py) instead of the "
        "standard suite: the training draw settings are chosen on, the unseen one the figures "
        "are reported on, or the held-out one that reported them until the fifteenth round",
    )
    parser.add_argument(
        "--count", type=int, default=50, help="landscapes in a random draw (default 50)"
    )
    parser.add_argument(
        "--other-seeds",
        type=int,
        help="seeds per landscape for the tuners other than distune (default: --seeds); the "
        "table's percentiles are then over fewer runs for them",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a quick look: 40 landscapes x 2 seeds, budgets 5,8,20, distune only",
    )
    parser.add_argument("--json", metavar="PATH", help="write every run's figures as JSON")
    parser.add_argument(
        "--runs",
        metavar="JSON",
        nargs="+",
        help="tables and plot from runs saved with --json instead of running tuners (to join "
        "tuners run in separate processes, with their own seed counts)",
    )
    parser.add_argument("--plot", metavar="PNG", type=Path, help="draw the curves (matplotlib)")
    args = parser.parse_args(argv)
    if args.draw and args.budgets == parser.get_default("budgets"):
        args.budgets = args.checkpoints = DRAW_BUDGETS
    if args.quick:
        args.count, args.seeds = min(args.count, 40), min(args.seeds, 2)
        args.budgets = args.checkpoints = "5,8,20"
        args.only = args.only or "distune"
    budgets = sorted({int(k) for k in f"{args.budgets},{args.checkpoints}".split(",")})
    checkpoints = [int(k) for k in args.checkpoints.split(",")]

    tuners = _tuners(args)
    landscapes, noise = _landscapes(args)
    started = time.perf_counter()
    if args.runs:
        runs = _saved_runs(parser, args.runs, checkpoints)
    else:
        mine = [t for t in tuners if t.name == "distune"]
        others = [t for t in tuners if t.name != "distune"]
        other_seeds = args.seeds if args.other_seeds is None else args.other_seeds
        first = args.first_seed
        runs = (
            compare(mine, landscapes, args.seeds, budgets, noise, args.jobs, first) if mine else []
        )
        if others:
            runs += compare(others, landscapes, other_seeds, budgets, noise, args.jobs, first)
    elapsed = time.perf_counter() - started

    what = f"{args.draw} draw of random clusters" if args.draw else "standard suite"
    seeds = _seeds_per_tuner(runs)
    print(
        f"# Tuner quality: {what}, {len(landscapes)} landscapes x {seeds}, "
        f"budgets {budgets} samples"
    )
    print(
        f"\nnoise: {noise}\nmachine: {platform.node()} ({platform.machine()}), "
        f"python {platform.python_version()}; {elapsed:.0f} s with {args.jobs} job(s)\n"
    )
    if args.draw:
        positions = sorted(optimum_position(ls) for ls in landscapes)
        hierarchical = sum(
            max(ls.throughput, key=ls.throughput.__getitem__).is_hierarchical_reduce
            for ls in landscapes
        )
        defaults = sorted(ls.default_fraction for ls in landscapes)
        print(
            f"best group's bucket size, as a position in the range (0 smallest, 1 largest): "
            f"min {positions[0]:.2f}, median {positions[len(positions) // 2]:.2f}, "
            f"max {positions[-1]:.2f}; hierarchical best on {hierarchical} of "
            f"{len(landscapes)}; default group's fraction of the best: median "
            f"{defaults[len(defaults) // 2]:.2f}, min {defaults[0]:.3f}\n"
        )
        print(percentile_table(runs, checkpoints))
        bars = " / ".join(f"{bar:.2f}" for bar in SHORTFALL_BARS)
        print(f"\nRuns that kept a group below {bars} of the best group:\n")
        print(shortfall_table(runs, checkpoints))
        coverage = coverage_table(runs, checkpoints)
        if coverage:
            print("\nHow often the reported gain's 95% interval holds the true gain:\n")
            print(coverage)
        _print_tuning_time(runs, checkpoints)
        if args.plot:
            percentile_plot(runs, args.plot, f"{what}: {len(landscapes)} landscapes x {seeds}")
        if args.json:
            save_runs(runs, args.json)
        return 0
    print(summary_table(runs, checkpoints))
    claims = gain_claim_table(runs, checkpoints)
    if claims:
        print("\nThe reported gain over the default group against the true one:\n")
        print(claims)
    print()
    print(per_landscape_table(runs, checkpoints))
    if args.plot:
        title = f"{len(landscapes)} landscapes x {args.seeds} seeds"
        plot(runs, args.plot, title)
    if args.json:
        save_runs(runs, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
