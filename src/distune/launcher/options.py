"""The autotune flags of ``distune-run``, added to torchrun's own parser, and their validation.

Every torchrun flag comes from ``torch.distributed.run.get_args_parser`` unchanged (defaults,
both spellings, ``PET_*`` fallbacks). The autotune flags are merged with an optional
``--autotune_config`` file (command-line flags win) into one frozen :class:`AutotuneOptions`.
Every invalid value is a :class:`OptionError` whose one-line message names the flag and what is
allowed; the launcher turns it into exit code 2 before anything starts.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import math
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields
from importlib.machinery import PathFinder
from pathlib import Path
from typing import Any, Literal, NoReturn
from urllib.parse import urlsplit

from torch.distributed.elastic.multiprocessing import Std
from torch.distributed.elastic.rendezvous import rendezvous_handler_registry
from torch.distributed.elastic.rendezvous.utils import (
    _parse_rendezvous_config,
    parse_rendezvous_endpoint,
)
from torch.distributed.run import (
    _get_logs_specs_class,
    determine_local_world_size,
    get_args_parser,
    parse_min_max_nnodes,
)

from distune.checks import InvalidValue, positive_seconds, whole_number_text
from distune.errors import ConfigError
from distune.launcher.config_file import load_config
from distune.space import BUCKET_SIZE_2P_LIMITS
from distune.tuning_service.config import TuningConfig, declared
from distune.tuning_service.trials.trial_config import CONFIG_KEYS, TrialConfigError, TrialPins
from distune.tuning_service.trials.trial_result import METRICS


class OptionError(ConfigError):
    """An autotune flag or config key holds a value it may not; the message names it."""


def _whole_number(low: int, high: int | None, allowed: str) -> Callable[[Any], int]:
    return lambda value: whole_number_text(value, low, high, allowed)


def _url(value: Any) -> str:
    text = str(value).strip().rstrip("/")
    try:
        parts = urlsplit(text)
        valid = (
            parts.scheme in ("http", "https")
            and bool(parts.hostname)
            and parts.port is not None
            and not (parts.path or parts.query or parts.fragment)
        )
    except ValueError:  # e.g. a port that is not a number
        valid = False
    if not valid:
        raise InvalidValue(f"must be a URL like http://HOST:PORT, got {value!r}")
    return text


def _listen_address(value: Any) -> str:
    text = value.strip().removeprefix("[").removesuffix("]") if isinstance(value, str) else ""
    # One colon is HOST:PORT (an IPv6 address has several); the port is another flag's.
    if not text or text.count(":") == 1 or any(c.isspace() or c in "/@?#[]" for c in text):
        raise InvalidValue(
            f"must be an address to listen on, like 0.0.0.0 or 10.0.0.5, got {value!r}"
        )
    return text


def _fraction(value: Any) -> float:
    """A fraction in (0, 1], from a number or its text."""
    number = math.nan
    if not isinstance(value, bool):  # YAML's `yes` is a bool, which Python counts as a number
        with contextlib.suppress(ValueError, TypeError):
            number = float(str(value).strip())
    if not (0.0 < number <= 1.0):
        raise InvalidValue(f"must be a fraction in (0, 1], e.g. 0.2, got {value!r}")
    return number


def _multiple(value: Any) -> float:
    """A number of times another setting, at least 1, from a number or its text."""
    number = math.nan
    if not isinstance(value, bool):
        with contextlib.suppress(ValueError, TypeError):
            number = float(str(value).strip())
    if not (math.isfinite(number) and number >= 1.0):
        raise InvalidValue(f"must be a number of at least 1, e.g. 5, got {value!r}")
    return number


def _bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise InvalidValue(f"must be true or false, got {value!r}")
    return value


def _output_path(value: Any) -> Path:
    """A file to create: its directory must exist and be writable, and it must not be a
    symlink."""
    if not isinstance(value, str | Path) or not str(value).strip():
        raise InvalidValue(f"must be a file path, got {value!r}")
    path = Path(value).expanduser()
    if not path.parent.is_dir():
        raise InvalidValue(f"directory {str(path.parent)!r} does not exist")
    if path.is_symlink():
        raise InvalidValue(f"{str(path)!r} is a symlink, which is refused")
    if path.is_dir():
        raise InvalidValue(f"{str(path)!r} is a directory, not a file")
    if path.exists() and not path.is_file():
        # /dev/null, a FIFO: the service refuses them as it starts, with its own usage text.
        raise InvalidValue(f"{str(path)!r} is not a regular file")
    # The best-file replaces itself through a new file beside it, so the directory must take
    # one: caught here, not by the service's start (the log) or at completion (the best-file).
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise InvalidValue(f"directory {str(path.parent)!r} is not writable")
    if path.exists() and not os.access(path, os.W_OK):
        raise InvalidValue(f"{str(path)!r} is not writable")
    return path


#: How a flag takes its value: ``value`` (``--flag V``), ``switch`` (``--flag`` sets True) or
#: ``on_off`` (``--flag`` and ``--no-flag``).
FlagKind = Literal["value", "switch", "on_off"]


@dataclass(frozen=True)
class Flag:
    """The declaration of one ``distune-run`` flag, held in its AutotuneOptions field.

    The flag (both spellings), its config-file key (the field's name), its ``--help`` line and
    its README row all come from here. ``parse`` takes the command line's text or the config
    file's value and returns the value or raises :class:`~distune.checks.InvalidValue`.
    ``service`` names the tuning service's flag that receives the value (a
    :class:`~distune.tuning_service.config.TuningConfig` field's name, whose declaration then
    supplies the help, the default and the range), or None for a launcher-only flag.
    ``level2`` marks a flag that only level 2's trials use: given on the command line at
    another level, it is refused rather than silently ignored. ``tuning`` marks one that only
    a tuning service uses (levels 1 and 2): given where none starts, it is named in a warning
    (:func:`unused_tuning_flags`).
    """

    parse: Callable[[Any], Any]
    help: str | None = None
    metavar: str | None = None
    kind: FlagKind = "value"
    service: str | None = None
    level2: bool = False
    tuning: bool = False

    def help_text(self) -> str:
        """The flag's help: its own, or the tuning setting's with the service's default."""
        if self.help is not None:
            return self.help
        assert self.service is not None, "a flag without help must name its tuning setting"
        setting = _TUNING_SETTINGS[self.service]
        default = getattr(TuningConfig(), self.service)
        if default is None:  # off unless given
            return setting.help
        shown = f"{default:g}" if isinstance(default, float) else str(default)
        return f"{setting.help} (default {shown})"


def flag_field(
    parse: Callable[[Any], Any],
    help: str | None = None,
    metavar: str | None = None,
    *,
    kind: FlagKind = "value",
    service: str | None = None,
    default: Any = None,
    level2: bool = False,
    tuning: bool = False,
) -> Any:
    """An AutotuneOptions field declared as a :class:`Flag`."""
    declaration = Flag(parse, help, metavar, kind, service, level2, tuning)
    return field(default=default, metadata={"flag": declaration})


_TUNING_SETTINGS = {item.name: setting for item, setting in declared(TuningConfig)}
_level = _whole_number(0, 2, "0, 1 or 2")
_positive_int = _whole_number(1, None, "an integer of at least 1")
# A bucket size is held as a power of two up to 2**48 (BUCKET_SIZE_2P_LIMITS); a larger one is
# refused here, by flag, rather than by a traceback when the service is started.
_bytes = _whole_number(
    1,
    1 << BUCKET_SIZE_2P_LIMITS[1],
    f"a positive whole number of bytes, at most 2**{BUCKET_SIZE_2P_LIMITS[1]} (256 TiB)",
)
_port = _whole_number(0, 65535, "a port in [0, 65535] (0: a free one)")


_BYTE_UNITS = {"": 1, "B": 1, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_BYTE_UNITS |= {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}


def _memory_size(value: Any) -> int:
    """Bytes, as a whole number or with a unit: ``512MiB``, ``2GiB``, ``1.5GB``."""
    text = "" if isinstance(value, bool) else str(value).strip().upper().replace(" ", "")
    number = text.rstrip("KMGTIB")
    size = math.nan
    if text[len(number) :] in _BYTE_UNITS:
        with contextlib.suppress(ValueError):
            size = float(number) * _BYTE_UNITS[text[len(number) :]]
    if not (math.isfinite(size) and size >= 1):
        raise InvalidValue(
            f"must be a number of bytes like 536870912, 512MiB or 2GiB, got {value!r}"
        )
    return int(size)


def _choice(*allowed: str) -> Callable[[Any], str]:
    def check(value: Any) -> str:
        if value not in allowed:
            raise InvalidValue(f"must be one of {', '.join(allowed)}, got {value!r}")
        return str(value)

    return check


def _directory(value: Any) -> Path:
    """A directory to write in: existing, or to be created in an existing one."""
    if not isinstance(value, str | Path) or not str(value).strip():
        raise InvalidValue(f"must be a directory path, got {value!r}")
    path = Path(value).expanduser()
    if path.exists() and not path.is_dir():
        raise InvalidValue(f"{str(path)!r} exists and is not a directory")
    if not path.exists() and not path.parent.is_dir():
        raise InvalidValue(f"directory {str(path.parent)!r} does not exist")
    where = path if path.exists() else path.parent
    if not os.access(where, os.W_OK | os.X_OK):
        raise InvalidValue(f"directory {str(where)!r} is not writable")
    return path


def _results_to_resume(value: Any) -> Path:
    path = _directory(value)
    if not (path / "trials.jsonl").is_file():
        raise InvalidValue(f"{str(path)!r} holds no trials.jsonl of an earlier level-2 run")
    return path


@dataclass(frozen=True)
class AutotuneOptions:
    """The autotune settings of one ``distune-run``, validated: the declaration of every
    autotune flag (see :class:`Flag`).

    ``None`` means "not given": the tuning service's own default applies (or, for the fixed
    knobs, the knob is tuned).
    """

    autotune_level: int = flag_field(
        _level,
        "0 (default): no tuning, no service; 1: online tuning of the communication knobs; "
        "2: trials of micro-batch, sharding and checkpointing, then level 1 (docs/level2.md)",
        "{0,1,2}",
        default=0,
    )
    autotune_max_samples: int | None = flag_field(
        _positive_int, metavar="N", service="max_samples", tuning=True
    )
    autotune_sampling_confidence_time: float | None = flag_field(
        positive_seconds, metavar="T", service="sampling_confidence_time", tuning=True
    )
    autotune_warmup_time: float | None = flag_field(
        positive_seconds, metavar="W", service="warmup_time", tuning=True
    )
    autotune_close_call_time: float | None = flag_field(
        _multiple, metavar="K", service="close_call_time", tuning=True
    )
    autotune_retune_drift: float | None = flag_field(
        _fraction, metavar="FRACTION", service="retune_drift", tuning=True
    )
    is_output_autotune_log: bool = flag_field(
        _bool,
        "write the CSV log to /tmp/distune_autotune_<random>.log",
        kind="switch",
        default=False,
        tuning=True,
    )
    autotune_log_file: Path | None = flag_field(
        _output_path, "write the CSV log to PATH (implies the log)", "PATH", tuning=True
    )
    autotune_service_port: int | None = flag_field(
        _port,
        "the service's port (default: a free one; multi-node: rendezvous port + 1)",
        "P",
        tuning=True,
    )
    autotune_service_addr: str | None = flag_field(
        _url, "where workers reach the service (multi-node: node 0's)", "URL", tuning=True
    )
    autotune_service_bind: str | None = flag_field(
        _listen_address,
        "where the service listens (default: its URL's address, never every interface; "
        "0.0.0.0 or :: only when asked, e.g. behind NAT)",
        "ADDR",
        tuning=True,
    )
    default_bucket_size: int | None = flag_field(
        _bytes, metavar="BYTES", service="default_bucket_size"
    )
    bucket_size: int | None = flag_field(_bytes, "pin the bucket size: it is not tuned", "BYTES")
    hierarchical_reduce: bool | None = flag_field(
        _bool, "pin hierarchical allreduce on or off: it is not tuned", kind="on_off"
    )
    autotune_best_file: Path | None = flag_field(
        _output_path,
        "write the chosen group and its measured gain as JSON to PATH",
        "PATH",
        service="best_file",
        tuning=True,
    )
    autotune_quiet: bool = flag_field(
        _bool,
        "no progress lines while tuning (the end-of-run summary is still printed)",
        kind="switch",
        default=False,
        tuning=True,
    )
    # Level 2 (docs/level2.md); its config keys (DeepSpeed's names) are pins: trial_pins().
    autotune_mode: str | None = flag_field(
        _choice("tune", "run"),
        "level 2: tune (trials only) or run (trials, then train with the best; default)",
        "{tune,run}",
        level2=True,
    )
    autotune_results_dir: Path | None = flag_field(
        _directory,
        "level 2: where trials.jsonl, summary.md, best_config.json and best_command.txt go "
        "(default: a new private /tmp/distune_level2_<random>)",
        "DIR",
        level2=True,
    )
    autotune_device_memory: int | None = flag_field(
        _memory_size,
        "cap each rank's tensor memory (e.g. 512MiB, 2GiB) in scripts that use "
        "distune.prepare: over it a step raises torch.OutOfMemoryError, on CPU too",
        "BYTES",
    )
    autotune_trial_timeout: float | None = flag_field(
        positive_seconds,
        "level 2: a trial with no finished step for S seconds is stopped as timeout (default 120)",
        "S",
        level2=True,
    )
    autotune_max_trials: int | None = flag_field(
        _whole_number(2, None, "an integer of at least 2"),
        "level 2: at most N trials (default 20)",
        "N",
        level2=True,
    )
    autotune_metric: str | None = flag_field(
        _choice(*METRICS),
        "level 2: throughput (samples a second, maximised; default) or latency (seconds a "
        "step, minimised)",
        "{throughput,latency}",
        level2=True,
    )
    autotune_allow_batch_change: bool = flag_field(
        _bool,
        "level 2: the global batch may change (it is held fixed otherwise)",
        kind="switch",
        default=False,
        level2=True,
    )
    autotune_resume: Path | None = flag_field(
        _results_to_resume, "level 2: reuse the trials already measured in DIR", "DIR", level2=True
    )

    @property
    def writes_log(self) -> bool:
        """Whether a CSV log is written (``--autotune_log_file`` implies it)."""
        return self.is_output_autotune_log or self.autotune_log_file is not None

    def service_values(self) -> dict[str, Any]:
        """The given values the tuning service takes, by its flag names (``max_samples``)."""
        values = {}
        for dest, declaration in flags():
            value = getattr(self, dest)
            if declaration.service is not None and value is not None:
                values[declaration.service] = value
        return values


def flags() -> Iterator[tuple[str, Flag]]:
    """Every autotune flag's destination (its field and config key) and declaration, in order."""
    for item in fields(AutotuneOptions):
        yield item.name, item.metadata["flag"]


#: The one flag that is not a setting: where the settings come from.
CONFIG_FLAG = "autotune_config"
CONFIG_HELP = "YAML or JSON with the same settings (keys are the flag names); flags win"
#: Keys a config file may hold besides the flags: the informational part of a best-file.
INFORMATIONAL_CONFIG_KEYS = frozenset({"autotune_result"})


def flag_table() -> str:
    """The README's table of the autotune flags, one row a flag, from their declarations."""
    rows = ["| flag | meaning |", "|---|---|"]
    for dest, declaration in flags():
        spelled = f"--{dest}" if declaration.kind != "on_off" else f"--[no-]{dest}"
        if declaration.metavar is not None:
            spelled += f" {declaration.metavar}"
        rows.append(f"| `{spelled}` | {_markdown(declaration.help_text())} |")
    rows.append(f"| `--{CONFIG_FLAG} FILE` | {_markdown(CONFIG_HELP)} |")
    return "\n".join(rows) + "\n"


def _markdown(text: str) -> str:
    # `<random>` would read as an HTML tag.
    return text.replace("<", "\\<").replace(">", "\\>")


class LauncherArgumentParser(argparse.ArgumentParser):
    """torchrun's parser, with one-line errors (``distune-run: error: ...``) and exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _cli_type(dest: str, parse: Callable[[Any], Any]) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except InvalidValue as error:
            # argparse prefixes the message with the flag's spellings.
            raise argparse.ArgumentTypeError(str(error)) from None

    convert.__name__ = dest  # argparse names the type in some messages
    return convert


def _add_flag(group: argparse._ArgumentGroup, dest: str, declaration: Flag) -> None:
    spellings = [f"--{dest}", f"--{dest.replace('_', '-')}"]
    if declaration.kind == "value":
        group.add_argument(
            *spellings,
            dest=dest,
            type=_cli_type(dest, declaration.parse),
            default=None,
            metavar=declaration.metavar,
            help=declaration.help_text(),
        )
        return
    group.add_argument(
        *spellings, dest=dest, action="store_const", const=True, default=None,
        help=declaration.help_text(),
    )  # fmt: skip
    if declaration.kind == "on_off":
        group.add_argument(
            f"--no-{dest}", f"--no_{dest}", f"--no-{dest.replace('_', '-')}",
            dest=dest, action="store_const", const=False, help=f"the opposite of --{dest}",
        )  # fmt: skip


def build_parser() -> LauncherArgumentParser:
    """torchrun's argument parser plus the autotune flags, both spellings of each."""
    parser = LauncherArgumentParser(
        prog="distune-run",
        description="torchrun with online tuning of data-parallel communication (distune).",
        parents=[get_args_parser()],
        add_help=False,  # the parent's -h/--help is inherited
    )
    group = parser.add_argument_group("autotune", "distune's flags; the others are torchrun's")
    for dest, declaration in flags():
        _add_flag(group, dest, declaration)
    group.add_argument(
        f"--{CONFIG_FLAG}",
        f"--{CONFIG_FLAG.replace('_', '-')}",
        dest=CONFIG_FLAG,
        default=None,
        metavar="FILE",
        help=CONFIG_HELP,
    )
    return parser


def _config_file_values(path: str) -> dict[str, Any]:
    """The settings of an ``--autotune_config`` file, each parsed by its flag's declaration."""
    if not path.strip():  # Path("") is ".", which the message would name instead
        raise OptionError(f"--autotune_config: must be a file path, got {path!r}")
    try:
        config = load_config(Path(path))
    except ConfigError as error:
        raise OptionError(f"--autotune_config: {error}") from None
    declarations = dict(flags())
    known = set(declarations) | CONFIG_KEYS
    unknown = sorted(set(config) - known - INFORMATIONAL_CONFIG_KEYS)
    if unknown:
        raise OptionError(
            f"--autotune_config: unknown key(s) {_unknown_keys(unknown, known)} in {path}; "
            f"allowed: {', '.join(sorted(known))}"
        )
    values = {}
    for dest, value in config.items():
        if dest in declarations:
            try:
                values[dest] = declarations[dest].parse(value)
            except InvalidValue as error:
                raise OptionError(f"--autotune_config: {dest} {error}") from None
    return values


#: Unknown keys named in one error, at most (a file that is no config may hold hundreds).
_UNKNOWN_SHOWN = 5
#: What a DeepSpeed autotuner user's config section means here (rather than a near-miss name).
_DEEPSPEED_AUTOTUNING = (
    "is DeepSpeed's autotuner section: give arg_mappings at the top level, and its other "
    "settings as flags (--autotune_level 2, --autotune_metric, --autotune_results_dir, "
    "--autotune_max_trials)"
)


def _unknown_keys(unknown: list[str], known: set[str]) -> str:
    """The unknown keys for an error message, each with the known key it may be a typo of."""
    shown = []
    for key in unknown[:_UNKNOWN_SHOWN]:
        close = difflib.get_close_matches(key, known, n=1)
        if key == "autotuning":
            shown.append(f"'autotuning' ({_DEEPSPEED_AUTOTUNING})")
        else:
            shown.append(f"{key[:60]!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    more = len(unknown) - _UNKNOWN_SHOWN
    return ", ".join(shown) + (f" and {more} more" if more > 0 else "")


def trial_pins(args: argparse.Namespace) -> TrialPins:
    """The level-2 keys of the ``--autotune_config`` file (DeepSpeed's names), validated: the
    values the user pinned. At levels 0 and 1 they reach the ranks too (a best_config.json)."""
    if args.autotune_config is None:
        return TrialPins()
    try:
        return TrialPins.from_config(load_config(Path(args.autotune_config)))
    except (ConfigError, TrialConfigError) as error:
        raise OptionError(f"--autotune_config: {error}") from None


def _check_tuning_ranges(options: AutotuneOptions) -> None:
    """Refuse now, by flag, a value the tuning service's declaration would refuse at start."""
    for dest, declaration in flags():
        value = getattr(options, dest)
        if declaration.service in _TUNING_SETTINGS and value is not None:
            try:
                _TUNING_SETTINGS[declaration.service].check(value)
            except InvalidValue as error:
                raise OptionError(f"argument --{dest}: {error}") from None


def options_from_args(args: argparse.Namespace) -> AutotuneOptions:
    """Merge the config file (if any) under the command-line flags and validate the result."""
    values: dict[str, Any] = {}
    if args.autotune_config is not None:
        values.update(_config_file_values(args.autotune_config))
    for dest, _ in flags():
        given = getattr(args, dest)
        if given is not None:
            values[dest] = given
    options = AutotuneOptions(**values)
    _check_tuning_ranges(options)
    trials_only = [
        dest for dest, flag in flags() if flag.level2 and getattr(args, dest) is not None
    ]
    if trials_only and options.autotune_level != 2:
        raise OptionError(
            f"argument --{trials_only[0]}: only level 2 runs trials, and this job is level "
            f"{options.autotune_level}: add --autotune_level 2, or leave it out"
        )
    _check_outputs(args, options)
    return options


def _check_outputs(args: argparse.Namespace, options: AutotuneOptions) -> None:
    """The log and the best-file are files of their own: the log is truncated as the service
    starts (a training script would be emptied before any rank reads it), and the best-file
    replaces its path when a model completes (the log would become JSON, rows gone). The
    best-file may be the config file read now: the next run of that command reads the newer
    choice."""
    inputs = [("the config file (--autotune_config)", args.autotune_config)]
    if not (args.module or args.no_python):
        inputs.append(("the training script", args.training_script))
    log, best = options.autotune_log_file, options.autotune_best_file
    truncates = "which the log would empty as the service starts"
    replaces = "which the best-file would replace when a model completes"
    clashes = [("--autotune_log_file", log, "--autotune_best_file", best, replaces)]
    clashes += [("--autotune_log_file", log, what, path, truncates) for what, path in inputs]
    clashes += [("--autotune_best_file", best, what, path, replaces) for what, path in inputs[1:]]
    for flag, output, what, other, why in clashes:
        if output is not None and other is not None and _same_file(output, Path(other)):
            raise OptionError(
                f"argument {flag}: {str(output)!r} is also {what}, {why}; give {flag} a file "
                "of its own"
            )


def _same_file(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` name one file (through links too), existing or not."""
    try:
        return a.expanduser().resolve() == b.expanduser().resolve() or a.samefile(b)
    except OSError:  # one does not exist (yet), or cannot be looked at
        return False


def unused_tuning_flags(
    args: argparse.Namespace, options: AutotuneOptions, tuned: bool
) -> str | None:
    """A warning naming the tuning flags typed on the command line of a job that starts no
    tuning service (``tuned`` False): a log or best-file asked for is never written, a sample
    budget never used. Level 0 is the default, so ``--autotune_level 1`` is easily forgotten;
    at level 1 every knob may be pinned. A warning, not an error: the same command at level 0
    is how a tuned run is compared with an untuned one. A config file's settings are not
    named: one file may serve several levels."""
    given = [f"--{dest}" for dest, flag in flags() if flag.tuning and getattr(args, dest)]
    if tuned or not given:
        return None
    these = "it takes" if len(given) == 1 else "they take"
    if options.autotune_level == 0:
        why = "this job is level 0, the default: ignored; add --autotune_level 1 to tune"
    elif one_rank(args):
        why = f"{ONE_RANK}: ignored"
    else:
        why = (
            "every knob of this job is pinned (--bucket_size, and --[no-]hierarchical_reduce "
            "where there are several nodes), so nothing is tuned and no service starts: ignored"
        )
    return f"{', '.join(given)}: {these} effect only where a job is tuned, and {why}"


#: Why a job of one rank is not tuned at level 1 (:func:`one_rank`).
ONE_RANK = (
    "this job has one rank (--nnodes 1, --nproc_per_node 1), which exchanges no gradients, so "
    "level 1 has nothing to tune and no service starts"
)


def one_rank(args: argparse.Namespace) -> bool:
    """Whether the job runs one rank, and can never run more (no ``--nnodes`` range above one
    node). Its gradients go to no other rank, so the communication knobs cannot change its
    speed: tuning them would only measure noise and report a gain where there is none (a
    1-rank run claimed +129 % +- 550 %). An elastic job that may grow is tuned as it runs."""
    _, max_nodes = parse_min_max_nnodes(args.nnodes)
    return max_nodes == 1 and local_world_size(args) == 1


def local_world_size(args: argparse.Namespace) -> int:
    """The ranks this node runs: ``--nproc_per_node``, a device keyword resolved on this
    machine (``gpu`` where CUDA is missing is an OptionError, not torch's traceback)."""
    try:
        return int(determine_local_world_size(args.nproc_per_node))
    except ValueError as error:
        raise OptionError(
            f"argument --nproc_per_node: {args.nproc_per_node!r} on this machine: {error}"
        ) from None


def check_torchrun_flags(args: argparse.Namespace) -> None:
    """Reject torchrun flag values that torch would reject only once it runs, with a traceback,
    or never: a static ``--node_rank`` outside ``--nnodes`` waits for its rendezvous forever."""
    try:
        min_nodes, max_nodes = parse_min_max_nnodes(args.nnodes)
    except ValueError:
        min_nodes = max_nodes = 0
    if not 0 < min_nodes <= max_nodes:
        raise OptionError(
            f"argument --nnodes: must be N or MIN:MAX with 0 < MIN <= MAX, got {args.nnodes!r}"
        )
    # Device keywords are checked where the job runs (a recipe may be planned elsewhere).
    if args.nproc_per_node not in ("auto", "cpu", "gpu", "xpu"):
        try:
            processes = determine_local_world_size(args.nproc_per_node)
        except ValueError:
            processes = 0
        if processes < 1:
            raise OptionError(
                "argument --nproc_per_node: must be a number of processes or one of auto, cpu, "
                f"gpu, xpu, got {args.nproc_per_node!r}"
            )
    if args.standalone and min_nodes > 1:
        # torch would wait for the other nodes at a rendezvous on a random local port, which
        # no other node can know: until its join time-out, 10 minutes.
        raise OptionError(
            f"argument --standalone: runs one node, but --nnodes {args.nnodes} waits for "
            f"{min_nodes}; drop --standalone and give a rendezvous every node reaches"
        )
    if args.max_restarts < 0:
        raise OptionError(f"argument --max_restarts: must be 0 or more, got {args.max_restarts}")
    try:
        positive_seconds(args.monitor_interval)
    except InvalidValue as error:
        raise OptionError(f"argument --monitor_interval: {error}") from None
    if args.rdzv_backend == "static" and not args.standalone:
        _check_static_rendezvous(args, min_nodes, max_nodes)
    try:
        _parse_rendezvous_config(args.rdzv_conf)
    except ValueError as error:
        raise OptionError(f"argument --rdzv_conf: {error}") from None
    _check_rendezvous(args)
    _check_worker_output(args)
    if args.no_python and args.module:
        raise OptionError("arguments --no-python and --module (-m) cannot be used together")


def _check_static_rendezvous(args: argparse.Namespace, min_nodes: int, max_nodes: int) -> None:
    """torch's static rendezvous waits for ``max_nodes`` nodes whatever the minimum says, and
    for a ``--node_rank`` outside them forever."""
    if min_nodes != max_nodes:
        raise OptionError(
            f"argument --nnodes: {args.nnodes} is a range, but the static rendezvous (the "
            f"default --rdzv_backend) waits for all {max_nodes} nodes; for an elastic range give "
            "--rdzv_backend c10d --rdzv_endpoint HOST:PORT, or a fixed --nnodes"
        )
    if not 0 <= args.node_rank < max_nodes:
        raise OptionError(
            f"argument --node_rank: must be in [0, {max_nodes}) with --nnodes {args.nnodes}, "
            f"got {args.node_rank}"
        )


def check_training_script(args: argparse.Namespace) -> None:
    """The script (or ``-m`` module, or ``--no-python`` command) must be there to run: torch
    would start every rank, each failing with the interpreter's own complaint, after the
    service (and at level 2 a whole profile trial) started. Checked on the node that runs it."""
    script = str(args.training_script)
    if args.module:
        top = script.split(".", 1)[0]
        # Where ``python -m`` looks: the working directory first, then the path; the package
        # is not imported (its __init__ could run anything).
        if PathFinder.find_spec(top, [os.getcwd(), *sys.path]) is None:
            raise OptionError(
                f"module {script!r} (-m): no module named {top!r} in the working directory "
                f"({os.getcwd()}) or on the Python path"
            )
        return
    if args.no_python:
        found = shutil.which(script) if os.sep not in script else script
        if found is None or not (os.path.isfile(found) and os.access(found, os.X_OK)):
            where = "is not an executable file" if os.sep in script else "is not on the PATH"
            raise OptionError(f"--no-python command {script!r} {where}")
        return
    path = Path(script)
    if path.is_dir():
        if not (path / "__main__.py").is_file():
            raise OptionError(
                f"training script {script!r} is a directory without a __main__.py; give the "
                "script's file"
            )
    elif not path.is_file():
        command = os.sep not in script and shutil.which(script) is not None
        raise OptionError(
            f"training script {script!r}: no such file (the working directory is "
            f"{os.getcwd()}); "
            + (
                # `distune-run python train.py`, as one types `python train.py`
                f"{script!r} is a command: distune-run runs the script with its own Python, so "
                f"leave {script!r} out, or give --no-python to run a command"
                if command
                else "give the script's path, or -m for a module"
            )
        )
    elif not os.access(path, os.R_OK):
        raise OptionError(f"training script {script!r} is not readable")


def _check_rendezvous(args: argparse.Namespace) -> None:
    """The rendezvous backend and endpoint, which torch checks only as the agent starts."""
    # torch has no public list of its registered backends; its registry holds them.
    backends = sorted(rendezvous_handler_registry._registry)
    if not args.standalone and args.rdzv_backend not in backends:
        raise OptionError(
            f"argument --rdzv_backend: must be one of {', '.join(backends)}, "
            f"got {args.rdzv_backend!r}"
        )
    if args.rdzv_endpoint:
        try:
            parse_rendezvous_endpoint(args.rdzv_endpoint, default_port=29400)
        except ValueError as error:
            raise OptionError(f"argument --rdzv_endpoint: {error}") from None


def _check_worker_output(args: argparse.Namespace) -> None:
    """Where and how the workers' output goes: --redirects, --tee, --log_dir,
    --local_ranks_filter and --logs_specs, which torch checks only as it launches."""
    for flag in ("redirects", "tee"):
        try:
            Std.from_str(getattr(args, flag))
        except ValueError:
            raise OptionError(
                f"argument --{flag}: must be 0 (none), 1 (stdout), 2 (stderr) or 3 (both), or "
                f"per local rank like 0:1,1:2, got {getattr(args, flag)!r}"
            ) from None
    if args.local_ranks_filter:
        try:
            ranks = [int(rank) for rank in args.local_ranks_filter.split(",")]
        except ValueError:
            ranks = []
        if not ranks or min(ranks) < 0:
            raise OptionError(
                "argument --local_ranks_filter: must be local ranks separated by commas like "
                f"0,1, got {args.local_ranks_filter!r}"
            )
    if args.log_dir is not None:
        _check_log_dir(args.log_dir)
    try:
        _get_logs_specs_class(args.logs_specs)
    except ValueError as error:
        raise OptionError(f"argument --logs_specs: {error}") from None


def _check_log_dir(log_dir: str) -> None:
    """--log_dir: a directory, or one that can be created (torch creates it)."""
    path = Path(log_dir).expanduser().absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise OptionError(
            f"argument --log_dir: {str(existing)!r} is not a directory, so {log_dir!r} cannot "
            "be one"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise OptionError(f"argument --log_dir: {str(existing)!r} is not writable")


def parse(argv: list[str] | None = None) -> tuple[argparse.Namespace, AutotuneOptions]:
    """Parse a ``distune-run`` command line; exit 2 with one line on any invalid value."""
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        check_torchrun_flags(args)
        return args, options_from_args(args)
    except OptionError as error:
        parser.error(str(error))
