"""``distune``: the entry point; with no command it lists the commands."""

from __future__ import annotations

import argparse
import os
import sys

import distune
from distune.cli import CommandError, log, plot, status
from distune.errors import ServiceError


def build_parser() -> argparse.ArgumentParser:
    """The ``distune`` parser with its subcommands."""
    parser = argparse.ArgumentParser(
        prog="distune",
        description="See what distune's tuner is doing and what it found. "
        "Launch training with distune-run.",
    )
    parser.add_argument("--version", action="version", version=f"distune {distune.__version__}")
    commands = parser.add_subparsers(dest="command", title="commands", metavar="COMMAND")
    for command in (status, plot, log):
        command.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run a ``distune`` command; returns its exit status (1: it failed, 2: bad arguments)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return int(args.run(args))
    except (CommandError, ServiceError) as error:
        print(f"distune {args.command}: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `distune log LOG | head`: the reader left. Point stdout at /dev/null so that the
        # interpreter's final flush does not fail again (Python's documented recipe).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
