"""Reading an ``--autotune_config`` file: YAML or JSON (JSON is YAML), one mapping of settings.

The keys are the launcher's flag names without dashes (``autotune_max_samples: 20``); a
best-file written by ``--autotune_best_file`` is a valid config file. Checking the keys and
their values is the options module's job; this one only turns a file into a mapping.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from distune.errors import ConfigError


def load_config(path: Path) -> dict[str, Any]:
    """The settings in ``path``; an empty file holds none."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(
            f"cannot read {str(path)!r}: {getattr(error, 'strerror', None) or error}"
        ) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        where = getattr(error, "problem_mark", None)
        line = f" (line {where.line + 1})" if where is not None else ""
        raise ConfigError(f"{str(path)!r} is not valid YAML or JSON{line}") from None
    if data is None:
        return {}
    if not isinstance(data, dict) or not all(isinstance(key, str) for key in data):
        raise ConfigError(f"{str(path)!r} must hold a mapping of setting names to values")
    return data
