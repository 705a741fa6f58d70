"""Every import of the repository's own packages in benchmarks/ names a module that exists.

The benchmarks run rarely (BENCHMARKS.md gives their commands) and no test starts most of them,
so a helper moved elsewhere breaks one silently until someone reruns it: the load-balanced
sampler's benchmark imported ``benchmarks.local_host`` long after it had moved to
``tests/support``. Read statically: no benchmark is imported or run here.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OWN = ("benchmarks", "tests", "distune")


def _module_exists(name: str) -> bool:
    parts = name.split(".")
    base = REPO / "src" if parts[0] == "distune" else REPO
    path = base.joinpath(*parts)
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _imported_modules(source: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(source.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # ``from package import name``: name may be a module or an attribute; the package
            # must exist either way, and a submodule is checked where there is one to check.
            names.add(node.module)
    return {name for name in names if name.split(".")[0] in OWN}


def test_every_own_import_in_the_benchmarks_resolves():
    missing = sorted(
        f"{source.relative_to(REPO)}: {name}"
        for source in (REPO / "benchmarks").rglob("*.py")
        for name in _imported_modules(source)
        if not _module_exists(name)
    )
    assert missing == []
