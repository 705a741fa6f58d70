"""The rules that pick level 2's testbed job, applied to profile-only runs.

Both rules (BENCHMARKS.md, "Level 2 policies", each written before any of its candidates ran)
take candidates in a fixed order, each profiled on one node by a level-2 run that stops after
its profile trial (``--autotune_max_trials 2``), and share three conditions:

* compute: the profile step t_c is at least ``K`` times the allreduce's link time on the
  testbed, 2 nodes x 1 rank at 1 gbit/s (:func:`~benchmarks.testbed.lower_bound.step_lower_bound`
  of the gradient bytes the profile reports);
* memory: DDP's predicted peaks (level 2's memory model from the profile alone) at the profile's
  micro-batch m and at 2m differ by at least 8 MiB, so a cap can separate them (m = M/4 for the
  context ladder's 2 x 4 profiles);
* time: t_c is at most 1.5 s, so two grid passes and a real run fit in the measuring window.

The cap is halfway between those two peaks, rounded down to a MiB: DDP reaches the script's
own micro-batch m and no more, as if the script's user had picked the largest that fits.

**The context rule** (part 13c, :func:`choose`): the first candidate meeting all three is the
job. A candidate that meets compute but fails memory or time ends the ladder. If no candidate
is the job, the nearest one is named instead: the largest compute ratio among those meeting
memory and time, reported as not the rule's job.

**The samples rule** (part 13j, :func:`choose_by_samples`): the candidates raise compute by
more samples a rank at a short context, the start's micro-batch fixed; each is profiled at its
start micro-batch m and, without a cap, at 2m and 4m. Two more conditions:

* sharding: some ZeRO stage without checkpointing is predicted to reach 2m under the cap (the
  cap stops DDP before sharding); the reach is the largest such micro-batch, up to 4m;
* pays: DDP's profile step at the reach is at least ``MIN_GAIN`` times faster than at m
  (a larger micro-batch gains more than sharding's extra traffic and the noise cost).

The first candidate meeting all five is the job; one failing time ends the ladder (a larger
candidate only takes longer). Otherwise the nearest, among those meeting memory and time, is
the one meeting most of compute, sharding and pays (ties: the larger gain, then the larger
ratio), reported as not the rule's job; none meeting memory and time: no job.

Usage::

    python -m benchmarks.testbed.job_rule PROFILE_DIR [PROFILE_DIR ...]   # context rule
    python -m benchmarks.testbed.job_rule --samples START,DOUBLE,QUADRUPLE ...   # samples rule
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.testbed.lower_bound import step_lower_bound
from benchmarks.testbed.rate import LinkRate
from distune.launcher.level2 import model_facts
from distune.tuning_service.trials.memory_model import MemoryModel
from distune.tuning_service.trials.trial_config import TrialConfig

#: t_c must be at least this many times the allreduce's link time.
K = 5.0
#: DDP's predicted peaks at micro-batches m and 2m must be at least this far apart.
MIN_SPAN_BYTES = 8 * 2**20
#: The longest profile step that still fits two passes and a real run in the window.
MAX_STEP_SECONDS = 1.5
#: The samples rule: DDP's step at the sharded reach must be this many times faster than at m.
#: Sharding's extra half allreduce is at most a tenth of a step where compute holds (K = 5), and
#: a gain is measurable beyond about 5 % (two runs of one configuration): 1.05 / 0.90 = 1.17.
MIN_GAIN = 1.15
#: The testbed the job is for.
NODES, RANKS_PER_NODE, RATE = 2, 1, LinkRate.parse("1gbit")
_MIB = 2**20


@dataclass(frozen=True)
class Candidate:
    """One profiled candidate's figures under the rule."""

    name: str
    step_seconds: float
    link_seconds: float
    peak_start: int
    peak_double: int

    @property
    def ratio(self) -> float:
        """t_c over the allreduce's link time."""
        return self.step_seconds / self.link_seconds

    @property
    def compute(self) -> bool:
        """The compute condition."""
        return self.ratio >= K

    @property
    def memory(self) -> bool:
        """The memory condition."""
        return self.peak_double - self.peak_start >= MIN_SPAN_BYTES

    @property
    def time(self) -> bool:
        """The time condition."""
        return self.step_seconds <= MAX_STEP_SECONDS

    @property
    def cap_mib(self) -> int:
        """The cap: halfway between the two peaks, rounded down to a MiB."""
        return (self.peak_start + self.peak_double) // 2 // _MIB


def _profile(results_dir: Path) -> tuple[dict[str, Any], TrialConfig]:
    """The facts and configuration of a profile-only run's first trial, which must be an ok
    profile."""
    lines = (results_dir / "trials.jsonl").read_text(encoding="utf-8").splitlines()
    row = json.loads(lines[0]) if lines else {}
    if row.get("purpose") != "profile" or row.get("outcome") != "ok":
        raise ValueError(f"{results_dir}: the first trial is not an ok profile trial")
    facts = row["facts"]
    return facts, TrialConfig(**facts["config"])


def _ddp(micro_batch: int, per_rank: int, stage: int = 0) -> TrialConfig:
    return TrialConfig(micro_batch, per_rank // micro_batch, stage, False, False)


def candidate(results_dir: Path) -> Candidate:
    """The rule's figures from a profile-only level-2 run's ``trials.jsonl`` (its first row)."""
    facts, profile = _profile(results_dir)
    per_rank = profile.micro_batch * profile.accumulation
    if per_rank % (2 * profile.micro_batch):
        raise ValueError(
            f"{results_dir}: {per_rank} samples a rank has no micro-batch twice the "
            f"profile's {profile.micro_batch}"
        )
    model = MemoryModel(model_facts(facts, profile))
    bound = step_lower_bound(
        compute_seconds=float(facts["step_seconds"]),
        gradient_bytes=float(facts["gradient_bytes"]),
        nodes=NODES,
        ranks_per_node=RANKS_PER_NODE,
        rate=RATE,
        shape="flat",
    )
    return Candidate(
        name=str(results_dir),
        step_seconds=bound.compute_seconds,
        link_seconds=bound.link_seconds,
        peak_start=model.predict(_ddp(profile.micro_batch, per_rank)),
        peak_double=model.predict(_ddp(2 * profile.micro_batch, per_rank)),
    )


def choose(candidates: Sequence[Candidate]) -> tuple[Candidate | None, str]:
    """The job and why: the first candidate meeting all three conditions, else the nearest."""
    reached: list[Candidate] = []
    for each in candidates:
        if each.compute and each.memory and each.time:
            return each, f"the job: {each.name}, cap {each.cap_mib} MiB"
        reached.append(each)
        if each.compute:
            break  # compute met but memory or time failed: the ladder ends
    fits = [c for c in reached if c.memory and c.time]
    if not fits:
        return None, "no job: no candidate meets memory and time"
    nearest = max(fits, key=lambda c: c.ratio)
    return nearest, (
        f"no candidate meets the rule; the nearest (largest ratio meeting memory and time, "
        f"NOT the rule's job): {nearest.name}, ratio {nearest.ratio:.2f}, "
        f"cap {nearest.cap_mib} MiB"
    )


@dataclass(frozen=True)
class SamplesCandidate:
    """One candidate's figures under the samples rule: its start profile's, the micro-batch
    sharding is predicted to reach under the cap, and DDP's measured gains at larger
    micro-batches."""

    base: Candidate
    start_micro_batch: int
    #: The largest micro-batch (up to 4m) some ZeRO stage without checkpointing is predicted
    #: to fit under the cap; m where none reaches 2m.
    reach: int
    #: (micro-batch, t_c at m over DDP's profile step at that micro-batch), one node, no cap.
    gains: tuple[tuple[int, float], ...]

    @property
    def shards(self) -> bool:
        """The sharding condition: a stage reaches 2m where DDP stops at m."""
        return self.reach >= 2 * self.start_micro_batch

    @property
    def gain(self) -> float | None:
        """DDP's gain at the reach; None where the reach is m or was not profiled."""
        return dict(self.gains).get(self.reach) if self.shards else None

    @property
    def pays(self) -> bool:
        """The pays condition: the gain at the reach is at least ``MIN_GAIN``."""
        return self.gain is not None and self.gain >= MIN_GAIN

    @property
    def met(self) -> int:
        """How many of compute, sharding and pays hold (the fallback's order)."""
        return sum((self.base.compute, self.shards, self.pays))


def samples_candidate(results_dirs: Sequence[Path]) -> SamplesCandidate:
    """The samples rule's figures: the first run is the start's profile (it gives the cap and
    the memory model), the others uncapped profiles of the same job at larger micro-batches."""
    base = candidate(results_dirs[0])
    facts, profile = _profile(results_dirs[0])
    per_rank = profile.micro_batch * profile.accumulation
    model = MemoryModel(model_facts(facts, profile))
    cap = base.cap_mib * _MIB
    reach = profile.micro_batch
    for micro_batch in (2 * profile.micro_batch, 4 * profile.micro_batch):
        fits = any(model.predict(_ddp(micro_batch, per_rank, s)) <= cap for s in (1, 2, 3))
        if micro_batch <= per_rank and fits:
            reach = micro_batch
    gains = []
    for larger in results_dirs[1:]:
        other_facts, other = _profile(larger)
        if other.micro_batch * other.accumulation != per_rank or other.stage != 0:
            raise ValueError(f"{larger}: not DDP at {per_rank} samples a rank like the start")
        gains.append((other.micro_batch, base.step_seconds / float(other_facts["step_seconds"])))
    return SamplesCandidate(base, profile.micro_batch, reach, tuple(sorted(gains)))


def choose_by_samples(
    candidates: Sequence[SamplesCandidate],
) -> tuple[SamplesCandidate | None, str]:
    """The samples rule's job and why: the first candidate meeting all five conditions, else
    the nearest."""
    reached: list[SamplesCandidate] = []
    for each in candidates:
        base = each.base
        if each.met == 3 and base.memory and base.time:
            return each, f"the job: {base.name}, cap {base.cap_mib} MiB"
        reached.append(each)
        if not base.time:
            break  # a larger candidate only takes longer: the ladder ends
    fits = [c for c in reached if c.base.memory and c.base.time]
    if not fits:
        return None, "no job: no candidate meets memory and time"
    nearest = max(fits, key=lambda c: (c.met, c.gain or 0.0, c.base.ratio))
    return nearest, (
        f"no candidate meets the rule; the nearest (most of compute, sharding and pays among "
        f"those meeting memory and time, NOT the rule's job): {nearest.base.name}, "
        f"{nearest.met} of 3, cap {nearest.base.cap_mib} MiB"
    )


def _yes(condition: bool) -> str:
    return "yes" if condition else "no"


def table(candidates: Sequence[Candidate]) -> str:
    """Each candidate's figures and conditions as a Markdown table."""
    lines = [
        "| candidate | t_c s | link s | ratio | DDP m, 2m MiB | span MiB | compute | memory "
        "| time |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [f"| {c.name} | {_figures(c)} |" for c in candidates]
    return "\n".join(lines)


def _figures(c: Candidate) -> str:
    span = (c.peak_double - c.peak_start) / _MIB
    return (
        f"{c.step_seconds:.3f} | {c.link_seconds:.4f} | {c.ratio:.2f} "
        f"| {c.peak_start / _MIB:.1f}, {c.peak_double / _MIB:.1f} | {span:.1f} "
        f"| {_yes(c.compute)} | {_yes(c.memory)} | {_yes(c.time)}"
    )


def samples_table(candidates: Sequence[SamplesCandidate]) -> str:
    """Each samples candidate's figures and five conditions as a Markdown table."""
    lines = [
        "| candidate | t_c s | link s | ratio | DDP m, 2m MiB | span MiB | compute | memory "
        "| time | cap MiB | sharded reach | DDP gains (micro-batch: x) | sharding | pays |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in candidates:
        gains = ", ".join(f"{mb}: {gain:.2f}" for mb, gain in c.gains) or "-"
        lines.append(
            f"| {c.base.name} | {_figures(c.base)} | {c.base.cap_mib} | {c.reach} | {gains} "
            f"| {_yes(c.shards)} | {_yes(c.pays)} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Print the candidates' figures and the rule's choice."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--samples",
        action="store_true",
        help="the samples rule: each candidate is START,LARGER[,LARGER...] profile runs",
    )
    parser.add_argument("profiles", nargs="+", help="profile-only runs, in candidate order")
    args = parser.parse_args(argv)
    try:
        if args.samples:
            ladder = [samples_candidate([Path(p) for p in c.split(",")]) for c in args.profiles]
            print(samples_table(ladder))
            print(choose_by_samples(ladder)[1])
        else:
            candidates = [candidate(Path(d)) for d in args.profiles]
            print(table(candidates))
            print(choose(candidates)[1])
    except (OSError, ValueError, KeyError) as error:
        parser.error(str(error))
    return 0


if __name__ == "__main__":
    sys.exit(main())
