"""The launcher's stop signals are torchrun's: each stops it in order (SignalException)."""

from __future__ import annotations

import subprocess
import sys

# What the launcher's main thread does: install the handlers, then get a signal.
LAUNCHER = """
import os, signal, sys, time
from torch.distributed.elastic.multiprocessing import SignalException
from distune.launcher.stop_signals import StopSignals
StopSignals().install()
try:
    os.kill(os.getpid(), signal.{name})
    time.sleep(30)
except SignalException as error:
    print("stopping on", error.sigval.name)
"""


def test_sigquit_raises_in_the_launcher_rather_than_end_it():
    # SIGQUIT (Ctrl-\) used to end the launcher with a core dump, leaving a trial running.
    code = LAUNCHER.format(name="SIGQUIT")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (0, "stopping on SIGQUIT\n"), done.stderr
