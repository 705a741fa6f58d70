"""A level-2 script's arguments for one configuration: ``arg_mappings`` applied.

A script that takes its micro-batch or accumulation as flags (``--batch_size 8``) gets the
configuration's values through them; the config's ``arg_mappings`` names the flags.
"""

from __future__ import annotations

from dataclasses import replace

from distune.tuning_service.trials.trial_config import ACCUMULATION, MICRO_BATCH, TrialPins


def _split_flag(script_args: list[str], flag: str) -> tuple[list[str], int | None]:
    """The script's arguments without any occurrence of ``flag`` (``--flag V`` or
    ``--flag=V``), and where its last occurrence stood among them (None: it had none)."""
    kept: list[str] = []
    at: int | None = None
    skip = False
    for arg in script_args:
        if skip:
            skip = False
        elif arg == flag or arg.startswith(f"{flag}="):
            skip = arg == flag
            at = len(kept)
        else:
            kept.append(arg)
    return kept, at


def without_flag(script_args: list[str], flag: str) -> list[str]:
    """The script's arguments without any occurrence of ``flag`` (``--flag V`` or
    ``--flag=V``)."""
    return _split_flag(script_args, flag)[0]


def flag_value(script_args: list[str], flag: str) -> str | None:
    """The value the script's parser sees for ``flag`` (its last ``--flag V`` or
    ``--flag=V``), or None where the arguments do not give it."""
    value = None
    # Each argument with the one after it (None after the last; no arguments, no pairs).
    for arg, following in zip(script_args, [*script_args[1:], None], strict=False):
        if arg == flag and following is not None:
            value = following
        elif arg.startswith(f"{flag}="):
            value = arg[len(flag) + 1 :]
    return value


def script_batch(script_args: list[str], pins: TrialPins) -> TrialPins:
    """``pins`` with the unpinned batch knobs that ``arg_mappings`` reach set to the values
    the script's own arguments give their flags (``--batch_size 20``): what the profile trial,
    which runs the script's own arguments, tells its ranks, so that a script measured through
    its wrapper has its micro-batch found in whichever dimension of its input holds it (a
    sequence-first model's input is ``(time, batch)``)."""
    own: dict[str, int] = {}
    for key, flag in pins.arg_mappings:
        value = flag_value(script_args, flag)
        if value is not None and value.isdigit() and int(value) > 0:
            own[key] = int(value)
    return replace(
        pins,
        micro_batch=pins.micro_batch or own.get(MICRO_BATCH),
        accumulation=pins.accumulation or own.get(ACCUMULATION),
    )


def unmapped_args(script_args: list[str], pins: TrialPins) -> list[str]:
    """The script's arguments without the flags ``arg_mappings`` names: what every trial
    passes alike."""
    for _, flag in pins.arg_mappings:
        script_args = without_flag(script_args, flag)
    return script_args


def with_flag(script_args: list[str], flag: str, value: str) -> list[str]:
    """The script's arguments with ``flag`` set to ``value``: its last occurrence (``--flag V``
    or ``--flag=V``) takes the value where it stands and the earlier ones are removed, so the
    script's parser reads it where the user put it (a flag of the main parser before a
    subcommand, ``train.py --bs 4 fit``, stays there); a flag the arguments do not give is
    appended."""
    kept, at = _split_flag(script_args, flag)
    if at is None:
        return [*kept, flag, value]
    return [*kept[:at], flag, value, *kept[at:]]


def rewrite_script_args(
    script_args: list[str], pins: TrialPins, micro_batch: int | None, accumulation: int | None
) -> list[str]:
    """The script's arguments with the mapped flags set to the configuration's values
    (:func:`with_flag`: in place where the arguments give them, else appended)."""
    values = {MICRO_BATCH: micro_batch, ACCUMULATION: accumulation}
    rewritten = list(script_args)
    for key, flag in pins.arg_mappings:
        value = values.get(key)
        if value is not None:
            rewritten = with_flag(rewritten, flag, str(value))
    return rewritten
