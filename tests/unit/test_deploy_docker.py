"""deploy/docker/Dockerfile: linted, and its structure checked, since no Docker engine runs here.

The build context is the repository root, filtered by /.dockerignore; docker-py's own
implementation of the .dockerignore rules says which files Docker would send.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

# docker-py's implementation of Docker's .dockerignore rules (the dev extra installs it).
exclude_paths = pytest.importorskip(
    "docker.utils.build", reason="docker-py is not installed; `make install` installs it"
).exclude_paths

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "deploy" / "docker" / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
SECRET_WORDS = re.compile(r"TOKEN|SECRET|PASSW|API_?KEY|CREDENTIAL", re.IGNORECASE)


@dataclass(frozen=True)
class Instruction:
    """One Dockerfile instruction, its continuation lines joined."""

    keyword: str
    arguments: str


def instructions(text: str) -> list[Instruction]:
    """The instructions of a Dockerfile (comments and blank lines dropped)."""
    result: list[Instruction] = []
    pending = ""
    for line in text.splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue  # a comment inside a continued instruction
        pending += " " + stripped.removesuffix("\\") if pending else stripped.removesuffix("\\")
        if not stripped.endswith("\\"):
            keyword, _, arguments = pending.partition(" ")
            result.append(Instruction(keyword.upper(), arguments.strip()))
            pending = ""
    assert not pending, "the Dockerfile ends inside a continued instruction"
    return result


def stages(parsed: list[Instruction]) -> list[list[Instruction]]:
    """The build stages, each starting with its FROM (global ARGs before the first are dropped)."""
    result: list[list[Instruction]] = []
    for instruction in parsed:
        if instruction.keyword == "FROM":
            result.append([])
        if result:
            result[-1].append(instruction)
    return result


def arg_defaults(parsed: list[Instruction]) -> dict[str, str]:
    """Every ``ARG NAME=default``."""
    return dict(
        instruction.arguments.split("=", 1)
        for instruction in parsed
        if instruction.keyword == "ARG" and "=" in instruction.arguments
    )


def copy_sources(parsed: list[Instruction]) -> list[tuple[list[str], str]]:
    """(sources, destination) of every COPY from the build context (not ``--from``)."""
    copies = []
    for instruction in parsed:
        if instruction.keyword != "COPY":
            continue
        words = instruction.arguments.split()
        if any(word.startswith("--from=") for word in words):
            continue
        paths = [word for word in words if not word.startswith("--")]
        copies.append((paths[:-1], paths[-1]))
    return copies


@pytest.fixture(scope="module")
def dockerfile() -> list[Instruction]:
    return instructions(DOCKERFILE.read_text())


@pytest.fixture(scope="module")
def context_files() -> set[str]:
    """The files Docker sends as the build context, relative to the repository root."""
    patterns = [
        line.strip()
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    relative = DOCKERFILE.relative_to(REPO).as_posix()
    return {
        path
        for path in exclude_paths(str(REPO), patterns, dockerfile=relative)
        if (REPO / path).is_file()
    }


def tool(name: str) -> str:
    """The path of a lint tool: the venv's (make install puts it there), else PATH's."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed; `make install` installs it (dev extra)")
    return found


def test_hadolint_finds_nothing():
    result = subprocess.run(
        [tool("hadolint"), "--failure-threshold", "style", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_multi_stage_with_a_non_root_runtime_whose_entry_point_is_distune_run(dockerfile):
    build, *_, runtime = stages(dockerfile)
    assert re.fullmatch(r"\S+ AS (\S+)", build[0].arguments, re.IGNORECASE)
    build_name = build[0].arguments.split()[-1]
    # The runtime stage takes the built environment, not the build's tools or sources.
    assert any(
        i.keyword == "COPY" and f"--from={build_name}" in i.arguments and "/opt/venv" in i.arguments
        for i in runtime
    )
    users = [i.arguments for i in runtime if i.keyword == "USER"]
    assert users, "the runtime stage must name a user"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, f"USER {users[-1]}: numeric and not root"
    entrypoints = [i.arguments for i in runtime if i.keyword == "ENTRYPOINT"]
    assert [json.loads(entry) for entry in entrypoints] == [["distune-run"]]
    assert not any(i.keyword == "COPY" and "/src" in i.arguments.split()[-1] for i in runtime)


def test_no_secret_is_baked_in(dockerfile, context_files):
    for instruction in dockerfile:
        if instruction.keyword in ("ENV", "ARG", "LABEL"):
            keys = re.findall(r"([A-Za-z_][\w.-]*)=", instruction.arguments) or [
                instruction.arguments.split()[0]
            ]
            assert not [key for key in keys if SECRET_WORDS.search(key)], instruction
        assert "DISTUNE_SERVICE_TOKEN" not in instruction.arguments, instruction
    assert not [path for path in context_files if SECRET_WORDS.search(Path(path).name)]


def test_base_python_and_torch_satisfy_the_project_requirements(dockerfile):
    defaults = arg_defaults(dockerfile)
    python = re.fullmatch(r"python:(\d+\.\d+)[\w.-]*", defaults["PYTHON_IMAGE"])
    assert python, defaults["PYTHON_IMAGE"]
    # The installed distune's metadata is pyproject.toml's (make install reinstalls on change).
    assert python.group(1) in SpecifierSet(metadata.metadata("distune")["Requires-Python"])
    torch = next(
        Requirement(line)
        for line in metadata.requires("distune") or []
        if Requirement(line).name == "torch"
    )
    assert defaults["TORCH_VERSION"] in torch.specifier


def test_build_context_holds_what_the_dockerfile_copies_and_nothing_else(dockerfile, context_files):
    for sources, _ in copy_sources(dockerfile):
        for source in sources:
            assert source in context_files or any(
                path.startswith(source.rstrip("/") + "/") for path in context_files
            ), f"COPY {source}: not in the build context"
    allowed = ("pyproject.toml", "README.md", "src/", "examples/", ".dockerignore")
    sent = {path for path in context_files if path != DOCKERFILE.relative_to(REPO).as_posix()}
    assert sent and all(path.startswith(allowed) for path in sent), sorted(sent)
    assert not [path for path in sent if "__pycache__" in path or ".egg-info" in path]
    assert "examples/train_gpt.py" in sent and "src/distune/run.py" in sent


@pytest.mark.slow
def test_the_build_stage_installs_distune_from_the_files_it_copies(
    dockerfile, context_files, tmp_path
):
    """Lay the context out as the build stage's COPY lines do, and build distune's wheel there."""
    pytest.importorskip("setuptools", reason="the wheel is built without build isolation")
    root = tmp_path / "image"
    build = stages(dockerfile)[0]
    for sources, destination in copy_sources(build):
        target = root / destination.lstrip("/")
        for source in sources:
            for path in sorted(context_files):
                if path == source:  # a file: into the destination directory
                    target.mkdir(parents=True, exist_ok=True)
                    shutil.copy(REPO / path, target / Path(path).name)
                elif path.startswith(source.rstrip("/") + "/"):  # a directory: its contents
                    copied = target / Path(path).relative_to(source)
                    copied.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy(REPO / path, copied)
    installs = [
        i.arguments.split("pip install ")[-1].split()[0]
        for i in build
        if i.keyword == "RUN" and "pip install /" in i.arguments
    ]
    assert installs == ["/src"]
    wheels = tmp_path / "wheels"
    subprocess.run(
        [
            *(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"),
            *("--wheel-dir", str(wheels), str(root / "src")),
        ],
        check=True,
        timeout=240,
    )
    (wheel,) = wheels.glob("distune-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        entry_points = next(name for name in names if name.endswith("entry_points.txt"))
        assert "distune-run = distune.run:main" in archive.read(entry_points).decode()
    assert {"distune/run.py", "distune/launcher/main.py", "distune/space.py"} <= names
