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
import math
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, NoReturn
from urllib.parse import urlsplit

from torch.distributed.elastic.rendezvous.utils import _parse_rendezvous_config
from torch.distributed.run import (
    determine_local_world_size,
    get_args_parser,
    parse_min_max_nnodes,
)

from distune.launcher.config_file import ConfigError, load_config
from distune.tuning_service.config import TuningConfig
from distune.tuning_service.trials.trial_config import CONFIG_KEYS, TrialConfigError, TrialPins
from distune.tuning_service.trials.trial_result import METRICS


class OptionError(ValueError):
    """An autotune flag or config key holds a value it may not; the message names it."""


@dataclass(frozen=True)
class AutotuneOptions:
    """The autotune settings of one ``distune-run``, validated.

    ``None`` means "not given": the tuning service's own default applies (or, for the fixed
    knobs, the knob is tuned).
    """

    autotune_level: int = 0
    autotune_max_samples: int | None = None
    autotune_sampling_confidence_time: float | None = None
    autotune_warmup_time: float | None = None
    is_output_autotune_log: bool = False
    autotune_log_file: Path | None = None
    autotune_service_port: int | None = None
    autotune_service_addr: str | None = None
    autotune_service_bind: str | None = None
    default_bucket_size: int | None = None
    bucket_size: int | None = None
    hierarchical_reduce: bool | None = None
    autotune_best_file: Path | None = None
    autotune_quiet: bool = False
    # Level 2 (trials); the level-2 config keys are the pins.
    autotune_mode: str | None = None
    autotune_results_dir: Path | None = None
    autotune_device_memory: int | None = None
    autotune_trial_timeout: float | None = None
    autotune_max_trials: int | None = None
    autotune_metric: str | None = None
    autotune_allow_batch_change: bool = False
    autotune_resume: Path | None = None
    trial_pins: TrialPins = field(default_factory=TrialPins)

    @property
    def writes_log(self) -> bool:
        """Whether a CSV log is written (``--autotune_log_file`` implies it)."""
        return self.is_output_autotune_log or self.autotune_log_file is not None


def _whole_number(low: int, high: int | None, allowed: str) -> Callable[[Any], int]:
    """A validator of whole numbers in [low, high] (``high`` None: no upper bound)."""

    def check(value: Any) -> int:
        number = None
        # YAML's `yes` and JSON's `true` parse to bool, which Python also treats as an int.
        if not isinstance(value, bool):
            with contextlib.suppress(ValueError):
                number = int(str(value).strip())
        if number is None or number < low or (high is not None and number > high):
            raise OptionError(f"must be {allowed}, got {value!r}")
        return number

    return check


_level = _whole_number(0, 2, "0, 1 or 2")
_positive_int = _whole_number(1, None, "an integer of at least 1")
_bytes = _whole_number(1, None, "a positive whole number of bytes")
_port = _whole_number(0, 65535, "a port in [0, 65535] (0: a free one)")


def _positive_seconds(value: Any) -> float:
    seconds = math.nan
    if not isinstance(value, bool):
        with contextlib.suppress(ValueError):
            seconds = float(str(value).strip())
    if not (math.isfinite(seconds) and seconds > 0):
        raise OptionError(f"must be a positive number of seconds, got {value!r}")
    return seconds


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
        raise OptionError(f"must be a URL like http://HOST:PORT, got {value!r}")
    return text


def _listen_address(value: Any) -> str:
    text = value.strip().removeprefix("[").removesuffix("]") if isinstance(value, str) else ""
    # One colon is HOST:PORT (an IPv6 address has several); the port is another flag's.
    if not text or text.count(":") == 1 or any(c.isspace() or c in "/@?#[]" for c in text):
        raise OptionError(
            f"must be an address to listen on, like 0.0.0.0 or 10.0.0.5, got {value!r}"
        )
    return text


def _bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise OptionError(f"must be true or false, got {value!r}")
    return value


def _output_path(value: Any) -> Path:
    """A file to create: its directory must exist, and it must not be a symlink."""
    if not isinstance(value, str | Path) or not str(value).strip():
        raise OptionError(f"must be a file path, got {value!r}")
    path = Path(value).expanduser()
    if not path.parent.is_dir():
        raise OptionError(f"directory {str(path.parent)!r} does not exist")
    if path.is_symlink():
        raise OptionError(f"{str(path)!r} is a symlink, which is refused")
    if path.is_dir():
        raise OptionError(f"{str(path)!r} is a directory, not a file")
    return path


_BYTE_UNITS = {"": 1, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_BYTE_UNITS |= {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "B": 1}


def _memory_size(value: Any) -> int:
    """Bytes, as a whole number or with a unit: ``512MiB``, ``2GiB``, ``1.5GB``."""
    text = str(value).strip().upper().replace(" ", "") if not isinstance(value, bool) else ""
    number = text.rstrip("KMGTIB")
    unit = text[len(number) :]
    size = math.nan
    if unit in _BYTE_UNITS:
        with contextlib.suppress(ValueError):
            size = float(number) * _BYTE_UNITS[unit]
    if not (math.isfinite(size) and size >= 1):
        raise OptionError(
            f"must be a number of bytes like 536870912, 512MiB or 2GiB, got {value!r}"
        )
    return int(size)


def _choice(*allowed: str) -> Callable[[Any], str]:
    def check(value: Any) -> str:
        if value not in allowed:
            raise OptionError(f"must be one of {', '.join(allowed)}, got {value!r}")
        return str(value)

    return check


def _directory(value: Any) -> Path:
    if not isinstance(value, str | Path) or not str(value).strip():
        raise OptionError(f"must be a directory path, got {value!r}")
    path = Path(value).expanduser()
    if path.exists() and not path.is_dir():
        raise OptionError(f"{str(path)!r} exists and is not a directory")
    if not path.exists() and not path.parent.is_dir():
        raise OptionError(f"directory {str(path.parent)!r} does not exist")
    return path


def _existing_directory(value: Any) -> Path:
    path = _directory(value)
    if not (path / "trials.jsonl").is_file():
        raise OptionError(f"{str(path)!r} holds no trials.jsonl of an earlier level-2 run")
    return path


# dest -> validator(value), shared by the command line and config files.
_VALIDATORS: Mapping[str, Callable[[Any], Any]] = {
    "autotune_level": _level,
    "autotune_max_samples": _positive_int,
    "autotune_sampling_confidence_time": _positive_seconds,
    "autotune_warmup_time": _positive_seconds,
    "is_output_autotune_log": _bool,
    "autotune_log_file": _output_path,
    "autotune_service_port": _port,
    "autotune_service_addr": _url,
    "autotune_service_bind": _listen_address,
    "default_bucket_size": _bytes,
    "bucket_size": _bytes,
    "hierarchical_reduce": _bool,
    "autotune_best_file": _output_path,
    "autotune_quiet": _bool,
    "autotune_mode": _choice("tune", "run"),
    "autotune_results_dir": _directory,
    "autotune_device_memory": _memory_size,
    "autotune_trial_timeout": _positive_seconds,
    "autotune_max_trials": _whole_number(2, None, "an integer of at least 2"),
    "autotune_metric": _choice(*METRICS),
    "autotune_allow_batch_change": _bool,
    "autotune_resume": _existing_directory,
}

#: Keys a config file may hold besides the flags: the informational part of a best-file.
INFORMATIONAL_CONFIG_KEYS = frozenset({"autotune_result"})


class LauncherArgumentParser(argparse.ArgumentParser):
    """torchrun's parser, with one-line errors (``distune-run: error: ...``) and exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _cli_type(dest: str) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return _VALIDATORS[dest](text)
        except OptionError as error:
            # argparse prefixes the message with the flag's spellings.
            raise argparse.ArgumentTypeError(str(error)) from None

    convert.__name__ = dest  # argparse names the type in some messages
    return convert


def build_parser() -> LauncherArgumentParser:
    """torchrun's argument parser plus the autotune flags, both spellings of each."""
    parser = LauncherArgumentParser(
        prog="distune-run",
        description="torchrun with online tuning of data-parallel communication (distune).",
        parents=[get_args_parser()],
        add_help=False,  # the parent's -h/--help is inherited
    )
    group = parser.add_argument_group("autotune", "distune's flags; the others are torchrun's")

    def add(dest: str, help_text: str, metavar: str | None = None) -> None:
        group.add_argument(
            f"--{dest}",
            f"--{dest.replace('_', '-')}",
            dest=dest,
            type=_cli_type(dest),
            default=None,
            metavar=metavar,
            help=help_text,
        )

    add(
        "autotune_level",
        "0: no tuning, no service (default); 1: tune online; 2: trials of micro-batch, "
        "sharding and checkpointing, then level 1",
        "{0,1,2}",
    )
    tuning = TuningConfig()  # the service's defaults, shown here; the service applies them
    add("autotune_max_samples", f"at most N sampled groups (default {tuning.max_samples})", "N")
    add(
        "autotune_sampling_confidence_time",
        f"seconds each group is measured (default {tuning.sampling_confidence_time:g})",
        "T",
    )
    add(
        "autotune_warmup_time",
        f"seconds ignored at the start (default {tuning.warmup_time:g})",
        "W",
    )
    group.add_argument(
        "--is_output_autotune_log",
        "--is-output-autotune-log",
        dest="is_output_autotune_log",
        action="store_const",
        const=True,
        default=None,
        help="write the CSV log to /tmp/distune_autotune_<random>.log",
    )
    add("autotune_log_file", "write the CSV log to PATH (implies the log)", "PATH")
    add("autotune_service_port", "port of the tuning service (default: a free one)", "P")
    add("autotune_service_addr", "where workers reach the service (multi-node: node 0's)", "URL")
    add(
        "autotune_service_bind",
        "where the service listens (default: the address of its URL, never every interface); "
        "0.0.0.0 or :: for every interface, e.g. behind NAT",
        "ADDR",
    )
    add("default_bucket_size", "the default group's bucket size (default 25 MiB)", "BYTES")
    add("bucket_size", "fix the bucket size: it is not tuned", "BYTES")
    group.add_argument(
        "--hierarchical_reduce",
        "--hierarchical-reduce",
        dest="hierarchical_reduce",
        action="store_const",
        const=True,
        default=None,
        help="fix hierarchical allreduce on: it is not tuned",
    )
    group.add_argument(
        "--no-hierarchical_reduce",
        "--no_hierarchical_reduce",
        "--no-hierarchical-reduce",
        dest="hierarchical_reduce",
        action="store_const",
        const=False,
        help="fix hierarchical allreduce off: it is not tuned",
    )
    group.add_argument(
        "--autotune_config",
        "--autotune-config",
        dest="autotune_config",
        default=None,
        metavar="FILE",
        help="YAML or JSON with the same settings (a best-file is one); flags win",
    )
    add("autotune_best_file", "write the chosen group and its gain as JSON here", "PATH")
    group.add_argument(
        "--autotune_quiet",
        "--autotune-quiet",
        dest="autotune_quiet",
        action="store_const",
        const=True,
        default=None,
        help="no progress lines while tuning (the end-of-run summary is still printed)",
    )
    add("autotune_mode", "level 2: tune (trials only) or run (trials, then train; default)", "MODE")
    add("autotune_results_dir", "level 2: where trials.jsonl and the rest go", "DIR")
    add("autotune_device_memory", "cap each rank's tensor memory (512MiB, 2GiB)", "BYTES")
    add("autotune_trial_timeout", "level 2: a trial with no finished step that long stops", "S")
    add("autotune_max_trials", "level 2: at most N trials (default 20)", "N")
    add("autotune_metric", "level 2: throughput (maximised, default) or latency", "METRIC")
    group.add_argument(
        "--autotune_allow_batch_change",
        "--autotune-allow-batch-change",
        dest="autotune_allow_batch_change",
        action="store_const",
        const=True,
        default=None,
        help="level 2: the global batch may change (it is fixed otherwise)",
    )
    add("autotune_resume", "level 2: skip trials already measured in DIR", "DIR")
    return parser


def options_from_args(args: argparse.Namespace) -> AutotuneOptions:
    """Merge the config file (if any) under the command-line flags and validate the result."""
    values: dict[str, Any] = {}
    if args.autotune_config is not None:
        try:
            config = load_config(Path(args.autotune_config))
        except ConfigError as error:
            raise OptionError(f"--autotune_config: {error}") from None
        settings = set(_VALIDATORS) | CONFIG_KEYS
        unknown = sorted(set(config) - settings - INFORMATIONAL_CONFIG_KEYS)
        if unknown:
            raise OptionError(
                f"--autotune_config: unknown key(s) {', '.join(map(repr, unknown))} in "
                f"{args.autotune_config}; allowed: {', '.join(sorted(settings))}"
            )
        try:
            values["trial_pins"] = TrialPins.from_config(config)
        except TrialConfigError as error:
            raise OptionError(f"--autotune_config: {error}") from None
        for dest, value in config.items():
            if dest in _VALIDATORS:
                try:
                    values[dest] = _VALIDATORS[dest](value)
                except OptionError as error:
                    raise OptionError(f"--autotune_config: {dest} {error}") from None
    for option in fields(AutotuneOptions):
        given = getattr(args, option.name, None)
        if given is not None:
            values[option.name] = given
    return AutotuneOptions(**values)


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
    if args.max_restarts < 0:
        raise OptionError(f"argument --max_restarts: must be 0 or more, got {args.max_restarts}")
    if not (math.isfinite(args.monitor_interval) and args.monitor_interval > 0):
        raise OptionError(
            f"argument --monitor_interval: must be a positive number of seconds, "
            f"got {args.monitor_interval}"
        )
    static = args.rdzv_backend == "static" and not args.standalone
    if static and not 0 <= args.node_rank < max_nodes:
        raise OptionError(
            f"argument --node_rank: must be in [0, {max_nodes}) with --nnodes {args.nnodes}, "
            f"got {args.node_rank}"
        )
    try:
        _parse_rendezvous_config(args.rdzv_conf)
    except ValueError as error:
        raise OptionError(f"argument --rdzv_conf: {error}") from None


def parse(argv: list[str] | None = None) -> tuple[argparse.Namespace, AutotuneOptions]:
    """Parse a ``distune-run`` command line; exit 2 with one line on any invalid value."""
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        check_torchrun_flags(args)
        return args, options_from_args(args)
    except OptionError as error:
        parser.error(str(error))
