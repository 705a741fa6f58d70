"""What goes wrong when bringing up or using the testbed."""

from __future__ import annotations


class TestbedError(RuntimeError):
    """An ``ip``/``tc`` command failed, or the network could not be built or torn down."""

    __test__ = False  # a name pytest would otherwise try to collect


class TestbedUnavailable(TestbedError):
    """This machine cannot host a testbed: not root, or iproute2 is missing. Names what lacks."""


class TestbedInterrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP arrived while a testbed was up; raised like Ctrl-C so teardown runs."""

    __test__ = False

    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by signal {signum}")
        self.signum = signum
