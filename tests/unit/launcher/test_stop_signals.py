"""The launcher's stop signals are torchrun's: each stops it in order (SignalException)."""

from __future__ import annotations

import os
import signal
import time

import pytest
from torch.distributed.elastic.multiprocessing import SignalException

from distune.launcher.stop_signals import STOP_SIGNALS, StopSignals


def test_sigquit_raises_in_the_launcher_rather_than_end_it():
    # SIGQUIT (Ctrl-\) used to end the launcher with a core dump, leaving a trial running.
    assert signal.SIGQUIT in STOP_SIGNALS  # (checked first: otherwise it would end pytest)
    handlers = {stop: signal.getsignal(stop) for stop in STOP_SIGNALS}
    wakeup = signal.set_wakeup_fd(-1)
    StopSignals().install()
    try:
        with pytest.raises(SignalException) as raised:
            os.kill(os.getpid(), signal.SIGQUIT)
            time.sleep(5)  # the handler raises at the next bytecode
        assert raised.value.sigval == signal.SIGQUIT
    finally:
        signal.set_wakeup_fd(wakeup)
        for stop, handler in handlers.items():
            signal.signal(stop, handler)
