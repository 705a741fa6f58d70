"""The rule that picks the compute-bound testbed job for level 2, applied to profile-only runs.

The rule (BENCHMARKS.md, "Level 2 policies", written before any candidate ran): candidates in
a fixed order, each profiled on one node by a level-2 run that stops after its profile trial
(``--autotune_max_trials 2``). A candidate is the job when all three conditions hold:

* compute: its profile step t_c is at least ``K`` times the allreduce's link time on the
  testbed, 2 nodes x 1 rank at 1 gbit/s (:func:`~benchmarks.testbed.lower_bound.step_lower_bound`
  of the gradient bytes the profile reports);
* memory: DDP's predicted peaks (level 2's memory model from the profile alone) at micro-batches
  M/4 and M/2 differ by at least 8 MiB, so a cap can separate them;
* time: t_c is at most 1.5 s, so two grid passes and a real run fit in the measuring window.

The first candidate meeting all three is the job, its cap halfway between those two peaks
(rounded down to a MiB). A candidate that meets compute but fails memory or time ends the
ladder. If no candidate is the job, the nearest one is named instead (fixed before any of
context 256 and 512 was profiled): the candidate with the largest compute ratio among those
meeting memory and time, reported as not the rule's job.

Usage::

    python -m benchmarks.testbed.job_rule PROFILE_DIR [PROFILE_DIR ...]   # in candidate order
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks.testbed.lower_bound import step_lower_bound
from benchmarks.testbed.rate import LinkRate
from distune.launcher.level2 import model_facts
from distune.tuning_service.trials.memory_model import MemoryModel
from distune.tuning_service.trials.trial_config import TrialConfig

#: t_c must be at least this many times the allreduce's link time.
K = 5.0
#: DDP's predicted peaks at M/4 and M/2 must be at least this far apart.
MIN_SPAN_BYTES = 8 * 2**20
#: The longest profile step that still fits two passes and a real run in the window.
MAX_STEP_SECONDS = 1.5
#: The testbed the job is for.
NODES, RANKS_PER_NODE, RATE = 2, 1, LinkRate.parse("1gbit")
_MIB = 2**20


@dataclass(frozen=True)
class Candidate:
    """One profiled candidate's figures under the rule."""

    name: str
    step_seconds: float
    link_seconds: float
    peak_quarter: int
    peak_half: int

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
        return self.peak_half - self.peak_quarter >= MIN_SPAN_BYTES

    @property
    def time(self) -> bool:
        """The time condition."""
        return self.step_seconds <= MAX_STEP_SECONDS

    @property
    def cap_mib(self) -> int:
        """The cap: halfway between the two peaks, rounded down to a MiB."""
        return (self.peak_quarter + self.peak_half) // 2 // _MIB


def candidate(results_dir: Path) -> Candidate:
    """The rule's figures from a profile-only level-2 run's ``trials.jsonl`` (its first row)."""
    lines = (results_dir / "trials.jsonl").read_text(encoding="utf-8").splitlines()
    row = json.loads(lines[0]) if lines else {}
    if row.get("purpose") != "profile" or row.get("outcome") != "ok":
        raise ValueError(f"{results_dir}: the first trial is not an ok profile trial")
    facts = row["facts"]
    profile = TrialConfig(**facts["config"])
    per_rank = profile.micro_batch * profile.accumulation
    if per_rank % 4:
        raise ValueError(f"{results_dir}: {per_rank} samples a rank has no M/4 micro-batch")
    model = MemoryModel(model_facts(facts, profile))

    def ddp(micro_batch: int) -> int:
        return model.predict(TrialConfig(micro_batch, per_rank // micro_batch, 0, False, False))

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
        peak_quarter=ddp(per_rank // 4),
        peak_half=ddp(per_rank // 2),
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


def table(candidates: Sequence[Candidate]) -> str:
    """Each candidate's figures and conditions as a Markdown table."""
    lines = [
        "| candidate | t_c s | link s | ratio | DDP M/4, M/2 MiB | span MiB | compute | memory "
        "| time |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in candidates:
        span = (c.peak_half - c.peak_quarter) / _MIB
        lines.append(
            f"| {c.name} | {c.step_seconds:.3f} | {c.link_seconds:.4f} | {c.ratio:.2f} "
            f"| {c.peak_quarter / _MIB:.1f}, {c.peak_half / _MIB:.1f} | {span:.1f} "
            f"| {'yes' if c.compute else 'no'} | {'yes' if c.memory else 'no'} "
            f"| {'yes' if c.time else 'no'} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Print the candidates' figures and the rule's choice."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("profiles", nargs="+", type=Path, help="profile-only runs, in order")
    args = parser.parse_args(argv)
    try:
        candidates = [candidate(d) for d in args.profiles]
    except (OSError, ValueError, KeyError) as error:
        parser.error(str(error))
    print(table(candidates))
    print(choose(candidates)[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
