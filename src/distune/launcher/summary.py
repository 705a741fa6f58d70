"""The end-of-run summary the launcher prints from the service's last ``/api/v1/status``."""

from __future__ import annotations

from typing import Any

from distune.space import HyperparameterError, Hyperparameters


def _group(group: Any) -> str:
    try:
        return Hyperparameters.from_dict(group["hyperparameters"]).describe()
    except (HyperparameterError, KeyError, TypeError):
        return "unknown group"


def _score(value: Any) -> str:
    return f"{value:.4g}/s" if isinstance(value, int | float) else "not measured"


def format_summary(
    status: dict[str, Any] | None, log_file: str | None, best_file: str | None
) -> list[str]:
    """Lines describing, per model, the chosen group, its score against the default's and the
    gain, how many groups were sampled, and where the log and best-file are."""
    if status is None:
        return ["distune: the tuning service did not answer at the end; the job kept its group"]
    lines = []
    for name, model in sorted(status.get("models", {}).items()):
        best = model.get("best")
        lines.append(
            f"distune: model {name}: {model.get('state')} after "
            f"{model.get('samples')} of at most {model.get('max_samples')} samples"
        )
        if best is None:
            lines.append(f"  current group: {_group(model.get('current'))} (nothing chosen yet)")
            continue
        gain = best.get("gain_vs_default")
        gain_text = f"{gain:+.1%}" if isinstance(gain, int | float) else "unknown"
        lines.append(
            f"  chosen group:  {_group(best.get('group'))}, score {_score(best.get('score'))}"
        )
        lines.append(
            f"  default group: score {_score(model.get('default_score'))}; gain {gain_text}"
        )
    if not lines:
        lines.append("distune: no model registered with the tuning service")
    if log_file:
        lines.append(f"distune: autotune log: {log_file}")
    if best_file:
        lines.append(f"distune: best-file: {best_file}")
    return lines
