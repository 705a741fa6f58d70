"""Which job a level-2 results directory holds the trials of: its ``job.json``.

A trial's measurement holds for one script with its arguments (the flags ``arg_mappings``
rewrites aside: they are what the trials vary), on one world of ranks and nodes, under one
memory cap and one set of pinned values, and for one content of the script: a script fixed
since a trial crashed would crash no more. ``--autotune_resume`` reuses trials by their
configuration alone, so resuming another job's directory would choose from measurements of
something else: the launcher refuses it before anything starts, naming what differs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from distune.errors import ConfigError
from distune.launcher.trial_args import unmapped_args
from distune.tuning_service.trials.trial_config import TrialPins

JOB_FILE = "job.json"
#: Fields an earlier version's job.json (or the job a node 0 of that version publishes) lacks.
_ADDED_LATER = frozenset({"script_sha256"})


class OtherJobError(ConfigError):
    """``--autotune_resume`` names the results of another job; the message says what differs."""


def _script(args: argparse.Namespace, absolute: bool = True) -> str:
    if args.module:
        return f"-m {args.training_script}"
    if args.no_python:
        return f"--no-python {args.training_script}"
    return os.path.abspath(args.training_script) if absolute else str(args.training_script)


def script_sha256(args: argparse.Namespace) -> str | None:
    """The SHA-256 of the training script's content (a directory's ``__main__.py``); None for
    a module (``-m``), a program (``--no-python``) or a file that cannot be read, whose
    content is not checked."""
    if args.module or args.no_python:
        return None
    path = Path(args.training_script)
    if path.is_dir():
        path = path / "__main__.py"
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


@dataclass(frozen=True)
class TunedJob:
    """What the trials of one level-2 run measured: the same job measures the same."""

    script: str
    script_args: list[str]
    world_size: int
    nnodes: int
    device_memory: int | None
    pinned: dict[str, Any] = field(default_factory=dict)
    script_sha256: str | None = None

    @classmethod
    def of(
        cls,
        args: argparse.Namespace,
        pins: TrialPins,
        device_memory: int | None,
        world: tuple[int, int],
    ) -> TunedJob:
        """This launch's job; ``world`` is the trials' (nodes, ranks)."""
        nnodes, world_size = world
        pinned = pins.pinned()
        if pins.arg_mappings:
            pinned["arg_mappings"] = dict(pins.arg_mappings)
        return cls(
            script=_script(args),
            script_args=unmapped_args(list(args.training_script_args), pins),
            world_size=world_size,
            nnodes=nnodes,
            device_memory=device_memory,
            pinned=pinned,
            script_sha256=script_sha256(args),
        )

    def as_given(self, args: argparse.Namespace) -> TunedJob:
        """This job as every node of a multi-node level 2 must launch it: the script as given
        on ``args``' command line (nodes may hold it in other directories)."""
        return replace(self, script=_script(args, absolute=False))

    def to_json(self) -> dict[str, Any]:
        """The job as a JSON object (``job.json``, and each trial node 0 publishes)."""
        return dict(json.loads(json.dumps(asdict(self))))

    def differences(self, recorded: dict[str, Any], there: str) -> list[str]:
        """Each field in which ``recorded`` (a job as JSON) differs from this one. A field
        added since the first ``job.json`` that it lacks was not recorded (an earlier version
        wrote it): that one is not compared."""
        mine = self.to_json()
        return [
            _difference(name, recorded.get(name), mine[name], there)
            for name in mine
            if recorded.get(name) != mine[name] and (name in recorded or name not in _ADDED_LATER)
        ]

    def write(self, directory: Path) -> None:
        """Record the job in its results directory."""
        (directory / JOB_FILE).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    def check_resume(self, directory: Path) -> bool:
        """Refuse (:class:`OtherJobError`) to resume ``directory`` where its trials are of
        another job; False where it records no job (written before ``job.json`` existed)."""
        try:
            recorded = json.loads((directory / JOB_FILE).read_text(encoding="utf-8"))
        except FileNotFoundError:
            return False
        except (OSError, ValueError) as error:
            raise OtherJobError(f"{directory / JOB_FILE} cannot be read: {error}") from None
        if not isinstance(recorded, dict):
            raise OtherJobError(
                f"{directory / JOB_FILE} holds no job record (a JSON object), but "
                f"{type(recorded).__name__} {json.dumps(recorded)[:60]}: was it edited? Start "
                "afresh with a new --autotune_results_dir"
            )
        differences = self.differences(recorded, "there")
        if differences:
            raise OtherJobError(
                f"the trials in {directory} are of another job ({'; '.join(differences)}): "
                "resume only the same script, unchanged, with the same arguments (the mapped "
                "flags aside), ranks, memory cap and pinned values, or start afresh with a new "
                "--autotune_results_dir"
            )
        return True


def _difference(name: str, theirs: Any, mine: Any, there: str) -> str:
    if name == "script_sha256" and isinstance(theirs, str) and isinstance(mine, str):
        return (
            f"script_sha256: {theirs[:12]}... {there}, {mine[:12]}... here (the script's "
            "content differs: what its trials measured, crashes included, may not hold)"
        )
    return f"{name}: {theirs!r} {there}, {mine!r} here"
