"""``distune status``: every model's tuning state, from a running service's ``/api/v1/status``.

A table by default, one row per model: its state, samples taken of the most it may take, the
group running now, and the best group (the choice, once completed) with its score and its gain
over the default group::

    MODEL   STATE     SAMPLES  CURRENT                      BEST                         SCORE  ...
    model0  sampling  4/20     bucket 2^22 B (4 MiB), flat  bucket 2^20 B (1 MiB), flat  12.31 it/s

With level 2, the trials come first: a line about the tuning and one row per recorded trial
(configuration, outcome, throughput, predicted and measured peak memory, the best marked *).
``--watch`` redraws it in place every ``--interval`` seconds until Ctrl-C; ``--json`` prints the
raw status document instead, one line per poll, for scripts.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
from typing import Any, TextIO

from distune.cli.service_client import ServiceConnection
from distune.cli.trial_table import format_trials
from distune.service_auth import SERVICE_TOKEN_FILE
from distune.wording import describe_group, format_gain, format_rate
from distune.worker_settings import SERVICE_TOKEN, SERVICE_URL

HEADER = ("MODEL", "STATE", "SAMPLES", "CURRENT", "BEST", "SCORE", "GAIN")
#: Terminal control: cursor home, then clear to the end of the screen.
_REDRAW = "\x1b[H\x1b[J"


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Add ``status`` to the ``distune`` command's subcommands."""
    parser = commands.add_parser(
        "status",
        help="the tuning state of every model, from a running tuning service",
        description="Print every model's tuning state: state, samples taken of the most, the "
        "group running now, the best group with its score and gain over the default group; "
        "with level 2, every trial: configuration, outcome, throughput, predicted and measured "
        "peak memory, and which is best.",
    )
    parser.add_argument(
        "--service",
        metavar="URL",
        help=f"the tuning service, e.g. http://127.0.0.1:29500 (default: ${SERVICE_URL})",
    )
    token = parser.add_mutually_exclusive_group()
    token.add_argument(
        "--token",
        help=f"the service's bearer token (default: ${SERVICE_TOKEN}); other users can see "
        "command lines, so prefer the environment or --token-file",
    )
    token.add_argument(
        "--token-file",
        "--token_file",
        metavar="FILE",
        help=f"read the token from FILE, which only you may read (default: ${SERVICE_TOKEN_FILE})",
    )
    parser.add_argument(
        "--watch", action="store_true", help="redraw every --interval seconds until Ctrl-C"
    )
    parser.add_argument(
        "--interval",
        metavar="S",
        type=_positive_seconds,
        default=2.0,
        help="seconds between two polls with --watch (default: %(default)s)",
    )
    parser.add_argument(
        "--json", action="store_true", help="print the raw status JSON, one line per poll"
    )
    parser.set_defaults(run=run)


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0.1 <= value <= 3600):
        raise argparse.ArgumentTypeError(f"must be seconds in [0.1, 3600], got {text!r}")
    return value


def format_table(status: dict[str, Any]) -> str:
    """The status document as an aligned text table, one row per model, sorted by name."""
    models = status.get("models") or {}
    if not models:
        return "no model has registered with the tuning service yet"
    rows = [HEADER]
    for name, model in sorted(models.items()):
        # A model registered again with other facts (wrapped again after unfreezing, restarted
        # on other nodes) was tuned afresh: one row per registration, oldest first, named as
        # `distune log` names them; nothing runs an earlier one's group now. An earlier one
        # replaced before its first sample wrote no log row, so the log cannot count it: it is
        # left out here too, or the two would number the later ones differently.
        earlier = [e for e in model.get("earlier") or [] if e.get("samples") != 0]
        sessions = [*earlier, model]
        for number, session in enumerate(sessions, 1):
            label = (
                name if len(sessions) == 1 else f"{name} (registration {number} of {len(sessions)})"
            )
            rows.append(_row(label, session, current=session is model))
    widths = [max(len(row[column]) for row in rows) for column in range(len(HEADER))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


def _row(
    label: str, session: dict[str, Any], current: bool
) -> tuple[str, str, str, str, str, str, str]:
    best = session.get("best") or {}
    return (
        label,
        str(session.get("state", "?")),
        f"{session.get('samples', '?')}/{session.get('max_samples', '?')}",
        describe_group(session.get("current")) if current else "-",
        describe_group(best.get("group")) if best else "-",
        format_rate(best.get("score")),
        format_gain(best.get("gain_vs_default")),
    )


def render(connection: ServiceConnection, as_json: bool) -> str:
    """The status (and level 2's trials, when the service has any) as text or one JSON line."""
    status = connection.status()
    trials = format_trials(document := connection.trials())
    if as_json:
        return json.dumps(status if trials is None else {**status, "trials": document})
    if trials is None:
        return format_table(status)
    if not status.get("models"):
        return trials  # no model registered yet: the trials are the news
    return f"{trials}\n\n{format_table(status)}"


def show(connection: ServiceConnection, as_json: bool, out: TextIO) -> None:
    """Print the status once."""
    print(render(connection, as_json), file=out, flush=True)


def watch(connection: ServiceConnection, interval: float, as_json: bool, out: TextIO) -> None:
    """Print the status every ``interval`` seconds until Ctrl-C (or the service is gone: then
    ServiceError). On a terminal the table is redrawn in place; elsewhere each poll is appended
    under a time stamp."""
    redraw = out.isatty() and not as_json
    while True:
        text = render(connection, as_json)
        if not as_json:
            stamp = time.strftime("%H:%M:%S")
            heading = f"{connection.url} at {stamp}, every {interval:g} s (Ctrl-C to stop)"
            text = f"{_REDRAW if redraw else ''}{heading}\n\n{text}\n"
        print(text, file=out, flush=True)
        time.sleep(interval)


def run(args: argparse.Namespace) -> int:
    """``distune status``; ServiceError when the service cannot be asked."""
    connection = ServiceConnection.resolve(args.service, args.token, args.token_file)
    if not args.watch:
        show(connection, args.json, sys.stdout)
        return 0
    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C is how a watch ends
        watch(connection, args.interval, args.json, sys.stdout)
    return 0
