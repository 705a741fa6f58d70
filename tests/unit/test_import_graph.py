"""The import rules of docs/architecture.md, checked on the real import graph.

A fresh interpreter imports the entry points one by one and lists what each brought: the
tuning service and the ``distune`` commands must load without torch, and the launcher without
the worker runtime. ruff's banned-API rule catches a direct ``import torch``; this catches one
that arrives through a chain of distune's own imports.
"""

import json
import subprocess
import sys

_PROBE = """
import importlib, json, sys
loaded = {}
for name in sys.argv[1:]:
    importlib.import_module(name)
    loaded[name] = sorted(sys.modules)
print(json.dumps(loaded))
"""


def _modules_loaded_by(*names: str) -> dict[str, set[str]]:
    """What was loaded once each of ``names`` had been imported, in order, in a fresh
    interpreter: a forbidden module shows first under the entry that brought it."""
    result = subprocess.run(
        [sys.executable, "-c", _PROBE, *names],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return {name: set(modules) for name, modules in json.loads(result.stdout).items()}


def _loaded(modules: set[str], package: str) -> list[str]:
    return sorted(m for m in modules if m == package or m.startswith(package + "."))


# Importing a __main__ module runs it; the service's __main__ imports only the server.
TORCH_FREE = [
    "distune",
    "distune.errors",
    "distune.checks",
    "distune.cut_line",
    "distune.space",
    "distune.worker_settings",
    "distune.trial_settings",
    "distune.service_auth",
    "distune.wording",
    "distune.tuning_service",
    "distune.tuning_service.server",
    # level 2's trial search and the variables its ranks read
    "distune.tuning_service.trials.trial_search",
    "distune.trial_settings",
    # the `distune` commands read only the API or the log
    "distune.cli.main",
    "distune.cli.status",
    "distune.cli.log",
    "distune.cli.plot",
]


def test_torch_free_parts_load_without_torch_the_runtime_or_the_launcher():
    for entry, modules in _modules_loaded_by(*TORCH_FREE).items():
        for forbidden in ("torch", "distune.worker_runtime", "distune.launcher"):
            assert _loaded(modules, forbidden) == [], f"importing {entry} loads {forbidden}"


def test_the_launcher_does_not_load_the_worker_runtime():
    modules = _modules_loaded_by("distune.launcher.main", "distune.run")["distune.run"]
    assert _loaded(modules, "distune.worker_runtime") == []
    assert "distune.tuning_service.config" in modules  # its settings' declaration


def test_the_probe_sees_torch_where_it_is_loaded():
    # Guards the test itself: the worker runtime does load torch, and the probe says so.
    loaded = _modules_loaded_by("distune.space", "distune.worker_runtime")
    assert "torch" not in loaded["distune.space"]
    assert "torch" in loaded["distune.worker_runtime"]
