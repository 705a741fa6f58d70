"""The ``distune-run`` launcher: torchrun's flags and agent, plus the tuning service's lifecycle.

It may import ``tuning_service`` (to start it) and ``space``; it never imports the worker runtime.
"""

from distune.launcher.main import main

__all__ = ["main"]
