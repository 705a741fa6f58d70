"""Running ``distune-run`` as a real subprocess and watching what it leaves behind."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.launcher_process import LauncherProcess, processes_with

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
SCRIPTS = Path(__file__).resolve().parent / "scripts"
# A small MLP: 6 groups from 2^16 to 2^21 bytes, a few ms a step.
SMALL_MLP = [str(EXAMPLES / "train_mlp.py"), "--width", "256", "--depth", "3", "--log-every", "0.5"]


class Launcher(LauncherProcess):
    """A ``distune-run`` subprocess for a test: waiting too long fails the test."""

    def wait_for(self, pattern: str, timeout: float) -> re.Match[str]:
        """The first output line matching ``pattern``; fails the test after ``timeout``."""
        match = self.wait_for_line(pattern, timeout)
        if match is None:
            pytest.fail(f"no line matching {pattern!r} in:\n{self.output}")
        return match

    def wait(self, timeout: float) -> int:
        """The exit code; fails the test (killing the tree) if it takes longer than ``timeout``."""
        code = super().wait(timeout)
        if code is None:
            self.kill_all()
            pytest.fail(f"distune-run did not finish in {timeout} s:\n{self.output}")
        return code

    def service_url(self, timeout: float = 60.0) -> str:
        """The URL the launcher printed for its tuning service."""
        return self.wait_for(r"tuning service at (http://\S+)", timeout).group(1)

    def leftovers(self, grace: float = 5.0) -> list[int]:
        """Processes of this launch still alive after ``grace`` seconds."""
        return super().leftovers(grace)


@pytest.fixture
def launch() -> Iterator[type[Launcher]]:
    """Start launchers; whatever they leave behind is killed at the end of the test."""
    started: list[Launcher] = []

    def start(argv: list[str], env: dict[str, str] | None = None) -> Launcher:
        launcher = Launcher(argv, env)
        started.append(launcher)
        return launcher

    yield start  # type: ignore[misc]
    for launcher in started:
        if launcher.process.poll() is None or processes_with(launcher.marker):
            launcher.kill_all()
