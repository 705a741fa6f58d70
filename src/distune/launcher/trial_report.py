"""Level 2's outputs: ``trials.jsonl`` as trials end, ``summary.md`` at the end, and the
progress line of each trial.

``trials.jsonl`` is appended and flushed trial by trial, so an interrupted run keeps every
finished trial (and ``--autotune_resume`` can skip them). ``summary.md`` has one row per
strategy (trials, best value, best trial), the whole (the winner, the time spent, the gain over
the script's own configuration, which the profile trial measured), and the search's decisions.
"""

from __future__ import annotations

import json
from pathlib import Path

from distune.tuning_service.trials.trial_config import STRATEGY_NAMES, TrialConfig
from distune.tuning_service.trials.trial_result import OK, THROUGHPUT, TrialResult
from distune.tuning_service.trials.trial_search import TrialSearch

MiB = 2**20


class TrialReport:
    """Writes the results directory of one level-2 run."""

    def __init__(self, directory: Path, metric: str) -> None:
        self.directory = directory
        self.metric = metric
        self.results: list[TrialResult] = []

    def add(self, result: TrialResult) -> None:
        """Append one trial to ``trials.jsonl``."""
        self.results.append(result)
        with open(self.directory / "trials.jsonl", "a", encoding="utf-8") as file:
            file.write(json.dumps(result.to_json()) + "\n")

    def _value(self, result: TrialResult) -> str:
        if self.metric == THROUGHPUT:
            return f"{result.throughput:.2f} samples/s"
        return f"{result.step_seconds:.3f} s/step"

    def line(self, result: TrialResult) -> str:
        """The progress line of a finished trial."""
        what = result.describe() + (f", {result.batch_change}" if result.batch_change else "")
        if result.outcome != OK:
            why = (result.error or "").strip().splitlines()
            return (
                f"trial {result.trial}: {what}: {result.outcome}"
                f"{f' ({why[-1][:160]})' if why else ''} after {result.duration:.1f} s"
            )
        peak = result.peak_memory_bytes or 0
        predicted = result.predicted_memory_bytes
        predicted_text = f" (predicted {predicted / MiB:.1f})" if predicted else ""
        spread = result.throughput_spread or 0.0
        return (
            f"trial {result.trial}: {what}: ok, {self._value(result)} "
            f"(spread {spread:.1%}), peak {peak / MiB:.1f} MiB{predicted_text}, "
            f"{result.duration:.1f} s"
        )

    def nothing_to_tune(self, config: TrialConfig) -> None:
        """Write ``summary.md`` of a run whose pins left one configuration: no trial ran."""
        lines = [
            "# distune level 2",
            "",
            f"Nothing to tune: the config pins every level-2 knob ({config.describe()}), so no "
            "trial ran and nothing was measured. best_config.json holds that configuration.",
        ]
        (self.directory / "summary.md").write_text("\n".join(lines) + "\n", encoding="utf-8")

    def finish(
        self,
        search: TrialSearch | None,
        decisions: list[str],
        seconds: float,
        stopped: str | None = None,
    ) -> None:
        """Write ``summary.md``; ``stopped`` says why the run ended before its search did (a
        signal, an error): the summary then holds the trials recorded so far, and says so."""
        lines = ["# distune level 2", ""]
        profile = next((r for r in self.results if r.purpose == "profile"), None)
        # Under --autotune_allow_batch_change a trial may train another global batch than the
        # script's own: said wherever it is, since its throughput is then not the same
        # training made faster.
        own_batch = profile.config.global_batch(profile.world_size) if profile else None

        def batch_of(config: TrialConfig, world_size: int) -> str:
            batch = config.global_batch(world_size)
            return "" if own_batch in (None, batch) else f", global batch {batch}"

        best = search.best() if search is not None else None
        unit = "samples/s" if self.metric == THROUGHPUT else "s/step"
        if stopped is not None:
            then = (
                f"the best below is the best so far, and `--autotune_resume {self.directory}` "
                "reuses these trials for the same job"
                if self.results
                else "no trial was recorded"
            )
            lines += [
                f"**Stopped** ({stopped}) after {len(self.results)} recorded trial(s), before "
                f"the search ended: nothing was chosen; {then}.",
                "",
            ]
        lines += [
            f"Metric: {self.metric} ({'maximised' if self.metric == THROUGHPUT else 'minimised'})."
            f" Trials: {len(self.results)}, {seconds:.0f} s in all.",
            "",
            f"| strategy | trials | ok | best ({unit}) | best trial |",
            "|---|---|---|---|---|",
        ]
        for stage, name in STRATEGY_NAMES.items():
            tried = [r for r in self.results if r.config.stage == stage]
            if not tried:
                continue
            good = [r for r in tried if r.outcome == OK]
            top = max(good, key=lambda r: r.value(self.metric)) if good else None
            value = self._value(top).split()[0] if top else "-"
            best_trial = f"{top.trial}: {top.config.describe()}" if top else "-"
            lines.append(f"| {name} | {len(tried)} | {len(good)} | {value} | {best_trial} |")
        lines.append("")
        if best is not None and search is not None and profile is not None:
            mean = sum(search.scores(best)) / len(search.scores(best))
            shown = mean if self.metric == THROUGHPUT else -mean
            title = "Best so far" if stopped is not None else "Best"
            changed = batch_of(best, profile.world_size)
            lines.append(
                f"**{title}:** {best.describe()}{changed}: {shown:.3f} {unit} (mean of its trials)."
            )
            if profile.outcome == OK:
                base = profile.value(self.metric)
                gain = mean / base if self.metric == THROUGHPUT else base / mean
                against = (
                    f" (the winner trains global batch {best.global_batch(profile.world_size)}"
                    f" against the script's {own_batch}: --autotune_allow_batch_change changed "
                    "the training, not only its speed)"
                    if changed
                    else ""
                )
                lines.append(
                    f"The script's own configuration ({profile.config.describe()}): "
                    f"{abs(base):.3f} {unit}; gain {gain:.2f}x{against}."
                )
        else:
            lines.append("**No configuration completed a trial.**")
        lines += [
            "",
            "| trial | purpose | configuration | outcome | value | peak MiB | "
            "predicted MiB | seconds |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in self.results:
            value = self._value(r) if r.outcome == OK else "-"
            peak = f"{r.peak_memory_bytes / MiB:.1f}" if r.peak_memory_bytes else "-"
            predicted = f"{r.predicted_memory_bytes / MiB:.1f}" if r.predicted_memory_bytes else "-"
            lines.append(
                f"| {r.trial} | {r.purpose} | {r.describe()}{batch_of(r.config, r.world_size)} "
                f"| {r.outcome} | {value} | "
                f"{peak} | {predicted} | {r.duration:.1f} |"
            )
        failed = [r for r in self.results if r.outcome != OK and r.error]
        for r in failed:
            lines += ["", f"Trial {r.trial} ({r.outcome}):", "", "```", r.error or "", "```"]
        if decisions:
            lines += ["", "Decisions:", "", *(f"- {d}" for d in decisions)]
        (self.directory / "summary.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
