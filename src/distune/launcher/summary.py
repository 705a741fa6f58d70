"""The end-of-run summary the launcher prints from the service's last ``/api/v1/status``."""

from __future__ import annotations

from typing import Any

from distune.wording import (
    counted,
    describe_group,
    describe_registration,
    format_gain,
    format_rate,
)


def format_summary(
    status: dict[str, Any] | None,
    log_file: str | None,
    best_file: str | None,
    *,
    service_gone: bool = False,
    exit_code: int | None = None,
    launcher_failed: bool = False,
) -> list[str]:
    """Lines describing, per model, the chosen group, its score against the default's and the
    gain, how many groups were sampled, and where the log and best-file are.

    With ``service_gone``, the service died during the job (which the launcher has reported
    already) and ``status`` is the last one it answered, if any. ``exit_code`` is the job's
    (None: unknown): a job that failed, or was stopped, before any model registered is not
    said to have wrapped none. With ``launcher_failed``, the launcher itself stopped on an
    error (a rendezvous that timed out, say), so no script may have run at all: it is not
    blamed either.
    """
    lines = []
    if status is None and not service_gone:
        lines.append(
            "distune: the tuning service did not answer at the end; the job kept its group"
        )
    as_of = " (as last reported)" if service_gone else ""
    for name, model in sorted((status or {}).get("models", {}).items()):
        best = model.get("best")
        lines.append(
            f"distune: model {name}: {model.get('state')} after "
            f"{model.get('samples')} of at most {counted(model.get('max_samples'), 'sample')}"
            f"{as_of}"
        )
        lines.extend(_earlier(model))
        if best is None:
            current = describe_group(model.get("current"), "an unknown group")
            lines.append(f"  current group: {current} (nothing chosen yet)")
            continue
        chosen, score = (
            describe_group(best.get("group"), "an unknown group"),
            format_rate(best.get("score"), "not measured"),
        )
        if model.get("state") == "completed":
            lines.append(f"  chosen group:  {chosen}, {score}")
        else:
            # Tuning did not finish: nothing was chosen. The service's current group is the one
            # it was sampling; the job may not have switched to it yet (it learns of a switch at
            # its next sync point), so the line says what the service knows, not what ran last.
            current = describe_group(model.get("current"), "an unknown group")
            lines.append(
                f"  best so far:   {chosen}, {score} (sampling {current} when the job ended)"
            )
        gain = _gain(best)
        lines.append(
            f"  default group: {format_rate(model.get('default_score'), 'not measured')}; "
            f"gain {gain}"
        )
        # The service's verdict, unless the gain said it already (the default group leads).
        if model.get("verdict") and gain != _DEFAULT_LEADS:
            lines.append(f"  {model['verdict']}")
    if status is not None and not lines and launcher_failed:
        lines.append(
            "distune: nothing was tuned: the launcher stopped on an error before any model "
            "registered (see its error)"
        )
    elif status is not None and not lines and exit_code:
        lines.append(
            f"distune: no model registered with the tuning service: nothing was tuned (the job "
            f"ended with exit code {exit_code} before any model registered; see above why)"
        )
    elif status is not None and not lines:
        lines.append(
            "distune: no model registered with the tuning service: nothing was tuned (the "
            "script wrapped no model in distune.DistributedDataParallel, or only under an "
            "algorithm with no knob to tune; torch's own DistributedDataParallel is not tuned)"
        )
    if log_file:
        lines.append(f"distune: autotune log: {log_file}")
    if best_file:
        lines.append(_best_file_line(status, best_file))
    return lines


def _best_file_line(status: dict[str, Any] | None, path: str) -> str:
    """Where the best-file is, and whether it holds this job's choices: the service writes it
    only when a model completes, and for a model registered again with other facts it holds
    the latest completed registration's choice (docs/tuning_service.md, "Files")."""
    models = (status or {}).get("models") or {}
    completed = [name for name, model in models.items() if model.get("state") == "completed"]
    reshaped = [
        name
        for name, model in sorted(models.items())
        if name not in completed
        and any(e.get("state") == "completed" for e in model.get("earlier") or [])
    ]
    if status is not None and not completed and not reshaped:
        return (
            f"distune: best-file: not written: no model completed tuning ({path} is left as it was)"
        )
    if not reshaped:
        return f"distune: best-file: {path}"
    return (
        f"distune: best-file: {path} (for {', '.join(reshaped)}, the choice of an earlier "
        "registration: its last registration, with other facts, did not complete)"
    )


def _earlier(model: dict[str, Any]) -> list[str]:
    """Lines on a model registered again with other facts (re-wrapped, or restarted on other
    nodes): the lines after them are of its latest registration; each earlier one's outcome."""
    earlier = model.get("earlier") or []
    if not earlier:
        return []
    lines = [f"  as registered last ({describe_registration(model.get('registration'))}); before:"]
    for registration in earlier:
        best = registration.get("best")
        outcome = (
            "nothing chosen"
            if best is None
            else f"{describe_group(best.get('group'), 'an unknown group')}, "
            f"{format_rate(best.get('score'), 'not measured')}, gain {_gain(best)}"
        )
        facts = describe_registration(registration.get("registration"))
        lines.append(
            f"  {facts}: {registration.get('state')} after {registration.get('samples')} "
            f"samples; {outcome}"
        )
        if registration.get("superseded_reports"):
            lines.append(
                "  warning: it kept reporting after the registration that replaced it: two "
                "models trained under this name at once; give each its own name="
            )
    return lines


#: The gain where the default group itself leads.
_DEFAULT_LEADS = "none: the default group is the best measured"


def _gain(best: dict[str, Any]) -> str:
    """The gain over the default with its interval's half-width where the service gave one,
    and whether that interval leaves zero out: a gain within the noise is not a gain."""
    if best.get("gain_vs_default") == 0 and best.get("gain_margin") == 0:
        # The default group itself leads: there is no gain, and no interval to give.
        return _DEFAULT_LEADS
    gain = format_gain(best.get("gain_vs_default"), "unknown", best.get("gain_margin"))
    if best.get("gain_margin") is None:
        return gain
    verdict = "measurably faster" if best.get("measurably_faster") else "within the noise"
    return f"{gain} ({verdict})"
