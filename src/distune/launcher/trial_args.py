"""A level-2 script's arguments for one configuration: ``arg_mappings`` applied.

A script that takes its micro-batch or accumulation as flags (``--batch_size 8``) gets the
configuration's values through them; the config's ``arg_mappings`` names the flags.
"""

from __future__ import annotations

from distune.tuning_service.trials.trial_config import ACCUMULATION, MICRO_BATCH, TrialPins


def without_flag(script_args: list[str], flag: str) -> list[str]:
    """The script's arguments without any occurrence of ``flag`` (``--flag V`` or
    ``--flag=V``)."""
    kept: list[str] = []
    skip = False
    for arg in script_args:
        if skip:
            skip = False
        elif arg == flag:
            skip = True
        elif not arg.startswith(f"{flag}="):
            kept.append(arg)
    return kept


def unmapped_args(script_args: list[str], pins: TrialPins) -> list[str]:
    """The script's arguments without the flags ``arg_mappings`` names: what every trial
    passes alike."""
    for _, flag in pins.arg_mappings:
        script_args = without_flag(script_args, flag)
    return script_args


def rewrite_script_args(
    script_args: list[str], pins: TrialPins, micro_batch: int | None, accumulation: int | None
) -> list[str]:
    """The script's arguments with the mapped flags set to the configuration's values.

    Every earlier occurrence of a mapped flag (``--flag V`` or ``--flag=V``) is removed, and the
    flag is appended with the new value, so the script's own parser sees it last.
    """
    values = {MICRO_BATCH: micro_batch, ACCUMULATION: accumulation}
    rewritten = list(script_args)
    for key, flag in pins.arg_mappings:
        value = values.get(key)
        if value is not None:
            rewritten = [*without_flag(rewritten, flag), flag, str(value)]
    return rewritten
