"""docs/architecture.md is the maintainers' map: every module of the package is on it.

A module added without a line on the map is a concept a new engineer cannot find; a module
named on the map that no longer exists sends them looking for it.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "src" / "distune"
MAP = REPO / "docs" / "architecture.md"


def _modules() -> set[str]:
    """Every module file's name under the package, without ``__init__``/``__main__``."""
    return {
        path.name
        for path in PACKAGE.rglob("*.py")
        if path.name not in ("__init__.py", "__main__.py")
    }


def test_every_module_is_on_the_map():
    text = MAP.read_text(encoding="utf-8")
    missing = sorted(name for name in _modules() if f"`{name}`" not in text)
    assert missing == [], f"docs/architecture.md names no line for {missing}"


def test_every_file_on_the_map_exists():
    named = set(re.findall(r"`(?:[\w/]+/)?(\w+\.py)`", MAP.read_text(encoding="utf-8")))
    existing = {
        path.name
        for folder in ("src", "tests", "benchmarks")
        for path in (REPO / folder).rglob("*.py")
    }
    assert sorted(named - existing) == []
