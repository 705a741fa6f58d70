"""Three ways to choose a level-2 configuration, replayed against one measured grid.

* **distune**: :class:`~distune.tuning_service.trials.trial_search.TrialSearch` with the memory
  model of the grid's profile trial, exactly as ``--autotune_level 2`` runs it.
* **DeepSpeed-style**: ZeRO stages in order (its autotuner does not tune checkpointing); per
  stage the largest micro-batch that fits by binary search, then three candidates (it and the
  two below), stopping when a stage is not 5 % faster than the best before it.
* **hand-tuning** (the seed's policy): DDP, micro-batch 1, then each larger candidate, until
  out of memory; with the global batch held the candidates are the per-rank batch's divisors.

Every policy starts with the profile trial (the script's own configuration), as level 2 does.
A policy's time is the sum of the measured durations of the trials it ran.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from distune.tuning_service.trials.memory_model import MemoryModel, ModelFacts
from distune.tuning_service.trials.trial_config import TrialConfig, TrialPins
from distune.tuning_service.trials.trial_result import OK, THROUGHPUT, TrialResult
from distune.tuning_service.trials.trial_search import TrialSearch
from distune.tuning_service.trials.trial_space import TrialSpace

DEEPSPEED_CANDIDATES = 3
DEEPSPEED_PLATEAU = 1.05


@dataclass(frozen=True)
class Choice:
    """What a policy ran and chose."""

    policy: str
    chosen: TrialConfig | None
    trials: int
    seconds: float
    #: The trials it ran, the profile first (with the memory predicted for each, where known).
    results: tuple[TrialResult, ...] = ()


class Grid:
    """The measured table: every configuration's one trial."""

    def __init__(self, table: dict[str, Any], first_pass: int | None = None) -> None:
        #: Which pass a policy's first measurement of a configuration sees (None: the mean).
        self.first_pass = first_pass
        self.world_size = int(table["world_size"])
        self.cap = table["cap"]
        facts = dict(table["facts"])
        self.profile = TrialConfig(*facts.pop("profile"))
        self.facts = ModelFacts(**facts, profile=self.profile)
        self.rows: dict[TrialConfig, dict[str, Any]] = {}
        self.profile_row = table["rows"][0]
        for row in table["rows"][1:]:
            self.rows[TrialConfig(*row["config"])] = row
        self.space = TrialSpace(TrialPins(), self.world_size, self.profile)

    def result(
        self, config: TrialConfig, index: int, purpose: str = "search", measurement: int = 0
    ) -> TrialResult:
        """The grid's trial of ``config`` as a result numbered ``index``: its ``measurement``-th
        measurement is pass ``first_pass + measurement`` (cycling over the passes that ran ok),
        so a policy sees single trials' noise, and a re-measure a different pass."""
        row = self.profile_row if purpose == "profile" else self.rows[config]
        ok = [p for p in row.get("passes", []) if p["outcome"] == OK]
        spreads = [p["throughput_spread"] for p in ok if p.get("throughput_spread") is not None]
        if self.first_pass is None or not ok:
            spread = sum(spreads) / len(spreads) if spreads else None
            measured = {**row, "throughput_spread": spread}
        else:
            measured = ok[(self.first_pass + measurement) % len(ok)]
        return TrialResult(
            trial=index,
            config=config,
            world_size=self.world_size,
            outcome=row["outcome"],
            purpose=purpose,
            throughput=measured["throughput"],
            throughput_spread=measured.get("throughput_spread"),
            step_seconds=measured["step_seconds"],
            peak_memory_bytes=row["peak_memory_bytes"],
            duration=row["duration"],
        )

    def throughput(self, config: TrialConfig | None) -> float:
        """The grid's throughput of ``config`` (0 if it did not run ok)."""
        row = self.rows.get(config) if config is not None else None
        return float(row["throughput"]) if row and row["outcome"] == OK else 0.0

    def best(self) -> TrialConfig:
        """The fastest configuration of the grid."""
        return max(self.rows, key=self.throughput)


class _Ledger:
    """A policy's trials: each config's result once (re-measuring costs its time again)."""

    def __init__(self, grid: Grid) -> None:
        self.grid = grid
        self.results = [grid.result(grid.profile, 0, "profile")]

    def run(
        self, config: TrialConfig, purpose: str = "search", predicted: int | None = None
    ) -> TrialResult:
        earlier = sum(r.config == config for r in self.results[1:])
        result = self.grid.result(config, len(self.results), purpose, earlier)
        result = replace(result, predicted_memory_bytes=predicted)
        self.results.append(result)
        return result

    def seconds(self) -> float:
        return sum(r.duration for r in self.results)


def distune_policy(grid: Grid, max_trials: int = 20) -> Choice:
    """Level 2's own search, fed from the grid."""
    search = TrialSearch(grid.space, MemoryModel(grid.facts), grid.cap, max_trials, THROUGHPUT)
    ledger = _Ledger(grid)
    search.record(ledger.results[0])
    while (proposal := search.next_trial()) is not None:
        search.record(
            ledger.run(proposal.config, proposal.purpose, proposal.predicted_memory_bytes)
        )
    return Choice(
        "distune (replayed)",
        search.best(),
        len(ledger.results),
        ledger.seconds(),
        tuple(ledger.results),
    )


def deepspeed_policy(grid: Grid) -> Choice:
    """Stages in order, binary search for the largest micro-batch, three candidates, plateau."""
    ledger = _Ledger(grid)
    micros = grid.space.micro_batches()
    measured: dict[TrialConfig, TrialResult] = {}

    def run(config: TrialConfig) -> TrialResult:
        if config not in measured:
            measured[config] = ledger.run(config)
        return measured[config]

    best: TrialResult | None = None
    for stage in grid.space.stages():
        low, high, largest = 0, len(micros) - 1, None
        while low <= high:
            middle = (low + high) // 2
            if run(grid.space.config(stage, False, micros[middle])).outcome == OK:
                largest, low = middle, middle + 1
            else:
                high = middle - 1
        if largest is None:
            continue
        candidates = micros[max(0, largest - DEEPSPEED_CANDIDATES + 1) : largest + 1]
        ok = [r for m in candidates if (r := run(grid.space.config(stage, False, m))).outcome == OK]
        stage_best = max(ok, key=lambda r: r.throughput or 0.0)
        if best is not None and (stage_best.throughput or 0.0) < DEEPSPEED_PLATEAU * (
            best.throughput or 0.0
        ):
            break
        if best is None or (stage_best.throughput or 0.0) > (best.throughput or 0.0):
            best = stage_best
    return Choice(
        "DeepSpeed-style", best.config if best else None, len(ledger.results), ledger.seconds()
    )


def hand_tuning_policy(grid: Grid) -> Choice:
    """DDP, micro-batch ascending from 1 until out of memory; the fastest that ran."""
    ledger = _Ledger(grid)
    ok: list[TrialResult] = []
    for micro in grid.space.micro_batches():
        result = ledger.run(grid.space.config(0, False, micro))
        if result.outcome != OK:
            break
        ok.append(result)
    best = max(ok, key=lambda r: r.throughput or 0.0) if ok else None
    return Choice(
        "hand-tuning", best.config if best else None, len(ledger.results), ledger.seconds()
    )


def table_at_cap(table: dict[str, Any], cap: int) -> dict[str, Any]:
    """The grid as it would have run under a smaller ``cap``: a configuration whose measured
    peak is over it is out of memory (peaks are the same in every pass). Real level-2 runs
    ran under the measured cap, so they are left out."""
    if table["cap"] is not None and cap > table["cap"]:
        raise ValueError(f"a grid measured under {table['cap']} bytes says nothing above it")
    rows = []
    for row in table["rows"]:
        over = row["outcome"] == OK and (row["peak_memory_bytes"] or 0) > cap
        if over and row is table["rows"][0]:
            raise ValueError(f"the profile trial's peak {row['peak_memory_bytes']} is over {cap}")
        rows.append({**row, "outcome": "oom", "throughput": None} if over else row)
    return {**table, "cap": cap, "rows": rows, "level2_runs": []}


def _spread(row: dict[str, Any]) -> str:
    values = row.get("throughputs") or []
    if len(values) < 2:
        return ""
    return f" ({min(values):.1f}-{max(values):.1f})"


def replayed_choices(grid: Grid) -> list[Choice]:
    """distune's search, the DeepSpeed-style policy and hand-tuning, replayed on ``grid``."""
    return [distune_policy(grid), deepspeed_policy(grid), hand_tuning_policy(grid)]


def real_runs(table: dict[str, Any]) -> list[Choice]:
    """The grid's real level-2 runs, each as what it ran (its own trials' durations) and chose."""
    runs = []
    for index, run in enumerate(table.get("level2_runs", []), 1):
        chosen = TrialConfig(*run["chosen"]) if run.get("chosen") else None
        label = "distune-run --autotune_level 2" + (f" (run {index})" if index > 1 else "")
        label += f", {run['label']}" if run.get("label") else ""
        runs.append(Choice(label, chosen, int(run["trials"]), float(run["seconds"])))
    return runs


def compare_table(table: dict[str, Any], first_pass: int | None = None) -> str:
    """The comparison as Markdown: each policy's trials, time, choice and its grid throughput
    (with the range over the grid's passes), the grid first and real level-2 runs last. The
    policies see the passes' mean, or with ``first_pass`` single passes (see Grid.result)."""
    grid = Grid(table, first_pass)
    best = grid.best()
    top = grid.throughput(best)
    grid_seconds = sum(row["duration"] for row in table["rows"])
    lines = [
        "| policy | trials | seconds | chosen | samples/s (grid) | of grid best |",
        "|---|---|---|---|---|---|",
        f"| exhaustive grid (one pass) | {len(table['rows'])} | {grid_seconds:.0f} | "
        f"{best.describe()} | {top:.1f}{_spread(grid.rows[best])} | 1.00 |",
    ]
    for choice in replayed_choices(grid) + real_runs(table):
        value = grid.throughput(choice.chosen)
        chosen_text = "none"
        if choice.chosen is not None:
            chosen_text = choice.chosen.describe()
            value_text = f"{value:.1f}{_spread(grid.rows[choice.chosen])}"
        else:
            value_text = "-"
        lines.append(
            f"| {choice.policy} | {choice.trials} | {choice.seconds:.0f} | {chosen_text} | "
            f"{value_text} | {value / top:.2f} |"
        )
    return "\n".join(lines)
