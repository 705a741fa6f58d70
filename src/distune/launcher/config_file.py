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


class _DuplicateKeyError(ConfigError):
    """A mapping gives one key twice; the message names it and both lines."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping: PyYAML (and Python's
    json) keep the last silently, so a setting edited in at the end of a file would quietly
    override one above it, or be overridden by one below."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        lines: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *defaults`: keys given beside it override the merged ones
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                first = lines.get(key)
            except TypeError:  # an unhashable key: the base constructor refuses it
                continue
            if first is not None:
                where = f"lines {first} and {line}" if first != line else f"both on line {line}"
                raise _DuplicateKeyError(f"key {key!r} is given twice ({where}): keep one")
            lines[key] = line
        return super().construct_mapping(node, deep)


def load_config(path: Path) -> dict[str, Any]:
    """The settings in ``path``; an empty file holds none."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(
            f"cannot read {str(path)!r}: {getattr(error, 'strerror', None) or error}"
        ) from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # a safe loader: SafeLoader's rules
    except _DuplicateKeyError as error:
        raise ConfigError(f"{str(path)!r}: {error}") from None
    except yaml.YAMLError as error:
        where = getattr(error, "problem_mark", None)
        line = f" (line {where.line + 1})" if where is not None else ""
        raise ConfigError(f"{str(path)!r} is not valid YAML or JSON{line}") from None
    if data is None:
        return {}
    if not isinstance(data, dict) or not all(isinstance(key, str) for key in data):
        raise ConfigError(f"{str(path)!r} must hold a mapping of setting names to values")
    return data
