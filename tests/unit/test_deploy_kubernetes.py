"""deploy/kubernetes: the manifests parse, hold what a Kubeflow PyTorchJob needs, and their
command lines, expanded as Kubernetes expands them with the variables the training operator
sets, parse with distune-run's own parser and place the tuning service on the master replica.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from distune.launcher import placement
from distune.launcher.options import build_parser, options_from_args
from distune.launcher.plan import LaunchPlan, plan_launch
from distune.space import Hyperparameters

REPO = Path(__file__).resolve().parents[2]
KUBERNETES = REPO / "deploy" / "kubernetes"
DOCKERFILE = REPO / "deploy" / "docker" / "Dockerfile"
JOBS = sorted(KUBERNETES.glob("pytorchjob*.yaml"))
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
# What the kubeflow.org/v1 PyTorchJob API requires of a replica.
CONTAINER_NAME = "pytorch"
MASTER_PORT_NAME = "pytorchjob-port"
RESTART_POLICIES = {"Always", "OnFailure", "Never", "ExitCode"}
# A best-file as the service writes it (docs/tuning_service.md), for the job that reuses one.
BEST_FILE = {
    "bucket_size": 2**22,
    "hierarchical_reduce": True,
    "autotune_result": {
        "models": {
            "gpt": {
                "group": {
                    "id": 3,
                    "hyperparameters": {"bucket_size_2p": 22, "is_hierarchical_reduce": True},
                },
                "score": 41.5,
                "default_score": 37.0,
                "gain_vs_default": 0.1216,
                "samples": 9,
            }
        }
    },
}


def documents(path: Path) -> list[dict[str, Any]]:
    """The YAML documents of one manifest file."""
    return [document for document in yaml.safe_load_all(path.read_text()) if document]


def replicas(job: dict[str, Any]) -> list[tuple[str, int, dict[str, Any]]]:
    """(replica type, index, pod spec) of every pod the operator creates for ``job``."""
    pods = []
    for kind, spec in job["spec"]["pytorchReplicaSpecs"].items():
        pods += [(kind, index, spec["template"]["spec"]) for index in range(spec["replicas"])]
    return pods


def pytorch_container(pod: dict[str, Any]) -> dict[str, Any]:
    (container,) = [c for c in pod["containers"] if c["name"] == CONTAINER_NAME]
    return container


def master_port(job: dict[str, Any]) -> int:
    master = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    ports = pytorch_container(master).get("ports", [])
    return next(port["containerPort"] for port in ports if port["name"] == MASTER_PORT_NAME)


def operator_env(job: dict[str, Any], kind: str, index: int) -> dict[str, str]:
    """The variables the training operator adds to a replica's container (with a Master)."""
    nodes = sum(spec["replicas"] for spec in job["spec"]["pytorchReplicaSpecs"].values())
    rank = index if kind == "Master" else index + 1
    nproc = job["spec"].get("nprocPerNode", "1")
    return {
        "MASTER_ADDR": f"{job['metadata']['name']}-master-0",  # the master's headless Service
        "MASTER_PORT": str(master_port(job)),
        "RANK": str(rank),
        "WORLD_SIZE": str(nodes * int(nproc)),
        "PET_NNODES": str(nodes),
        "PET_NODE_RANK": str(rank),
        "PET_NPROC_PER_NODE": nproc,
        "PYTHONUNBUFFERED": "0",
    }


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion in command and args (``$$`` escapes)."""
    return re.sub(
        r"\$\$|\$\((\w+)\)",
        lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)),
        text,
    )


def command_line(job: dict[str, Any], kind: str, index: int, pod: dict[str, Any]) -> list[str]:
    container = pytorch_container(pod)
    env = operator_env(job, kind, index)
    env.update({var["name"]: var["value"] for var in container.get("env", []) if "value" in var})
    argv = [expand(word, env) for word in container.get("command", []) + container["args"]]
    assert not [word for word in argv if "$(" in word], f"unexpanded variables in {argv}"
    return argv


def image_examples_dir() -> str:
    """Where the image puts examples/ (the Dockerfile's ``COPY examples DEST``)."""
    match = re.search(r"^COPY\s+examples\s+(\S+)", DOCKERFILE.read_text(), re.MULTILINE)
    assert match, "the Dockerfile copies no examples/"
    return match.group(1).rstrip("/")


def localize(argv: list[str], pod: dict[str, Any], root: Path) -> tuple[list[str], dict[str, Path]]:
    """``argv`` with each volume's mount path replaced by a local directory standing for it."""
    mounts = {
        mount["mountPath"].rstrip("/"): root / mount["name"]
        for mount in pytorch_container(pod).get("volumeMounts", [])
    }
    for local in mounts.values():
        local.mkdir(parents=True, exist_ok=True)
    localized = []
    for word in argv:
        for mount_path, local in mounts.items():
            word = re.sub(rf"(^|=){re.escape(mount_path)}/", rf"\g<1>{local}/", word)
        localized.append(word)
    return localized, mounts


def claims(node: Any) -> list[str]:
    """Every persistentVolumeClaim name a manifest refers to, at any depth."""
    if isinstance(node, dict):
        found = [node["claimName"]] if "claimName" in node else []
        return found + [name for value in node.values() for name in claims(value)]
    if isinstance(node, list):
        return [name for value in node for name in claims(value)]
    return []


def test_every_manifest_parses_names_its_kind_and_claims_only_declared_volumes():
    manifests = sorted(KUBERNETES.glob("*.yaml"))
    assert len(JOBS) >= 1 and len(manifests) > len(JOBS)
    declared = {
        document["metadata"]["name"]
        for path in manifests
        for document in documents(path)
        if document["kind"] == "PersistentVolumeClaim"
    }
    for path in manifests:
        for document in documents(path):
            assert {"apiVersion", "kind", "metadata"} <= document.keys(), path
            assert DNS_LABEL.fullmatch(document["metadata"]["name"]), path
            assert document["kind"] != "Secret", f"{path}: a secret belongs in the cluster"
            assert set(claims(document)) <= declared, path


@pytest.mark.parametrize("path", JOBS, ids=lambda path: path.name)
def test_pytorchjob_has_what_the_training_operator_needs(path):
    (job,) = documents(path)
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert set(specs) == {"Master", "Worker"}
    assert specs["Master"]["replicas"] == 1 and specs["Worker"]["replicas"] >= 1
    assert isinstance(job["spec"]["nprocPerNode"], str)  # the API's type
    assert master_port(job) > 0
    for kind, spec in specs.items():
        assert spec["restartPolicy"] in RESTART_POLICIES, kind
        pod = spec["template"]["spec"]
        container = pytorch_container(pod)
        assert container["image"] and container["command"] == ["distune-run"]
        gpus = container["resources"]["limits"]["nvidia.com/gpu"]
        assert str(gpus) == job["spec"]["nprocPerNode"], kind
        volumes = {volume["name"]: volume for volume in pod.get("volumes", [])}
        for mount in container.get("volumeMounts", []):
            assert mount["name"] in volumes, f"{kind}: mount of an undeclared volume"
        assert pod["securityContext"]["runAsNonRoot"] is True


@pytest.mark.parametrize("path", JOBS, ids=lambda path: path.name)
def test_token_comes_from_a_secret(path):
    (job,) = documents(path)
    for kind, _, pod in replicas(job):
        (token,) = [
            var
            for var in pytorch_container(pod).get("env", [])
            if var["name"] == "DISTUNE_SERVICE_TOKEN"
        ]
        assert "value" not in token, f"{kind}: the token must not be written in the manifest"
        assert token["valueFrom"]["secretKeyRef"]["name"], kind


@pytest.mark.parametrize("path", JOBS, ids=lambda path: path.name)
def test_command_lines_parse_and_place_the_service_on_the_master(path, tmp_path, monkeypatch):
    monkeypatch.setenv("DISTUNE_SERVICE_TOKEN", "from-the-secret")
    monkeypatch.delenv("DISTUNE_SYNC_INTERVAL", raising=False)
    (job,) = documents(path)
    nodes = len(replicas(job))
    plans: dict[tuple[str, int], LaunchPlan] = {}
    for kind, index, pod in replicas(job):
        argv, mounts = localize(command_line(job, kind, index, pod), pod, tmp_path / kind)
        for volume in pod.get("volumes", []):  # a ConfigMap made from a best-file (README)
            if "configMap" in volume:
                (tmp_path / kind / volume["name"] / "best.json").write_text(json.dumps(BEST_FILE))
        args = build_parser().parse_args(argv[1:])
        assert int(args.nnodes) == nodes
        assert args.nproc_per_node == job["spec"]["nprocPerNode"]
        assert args.training_script.startswith(image_examples_dir() + "/")
        example = Path(args.training_script).relative_to(image_examples_dir())
        assert (REPO / "examples" / example).is_file()
        options = options_from_args(args)
        for written in (options.autotune_log_file, options.autotune_best_file):
            # Files the job keeps must land on a volume, not in the container's own layer.
            assert written is None or any(
                written.is_relative_to(local) for local in mounts.values()
            ), written
        # Planned as that pod: its own host name is this machine's (here, no name resolves).
        own = f"{job['metadata']['name']}-{kind.lower()}-{index}"
        monkeypatch.setattr(placement, "is_local_address", lambda host, own=own: host == own)
        plans[kind, index] = plan_launch(args, options)

    master = plans["Master", 0]
    workers = [plan for (kind, _), plan in plans.items() if kind == "Worker"]
    if master.placement is None:  # settings fixed by a best-file: no service anywhere
        assert all(plan.placement is None for plan in workers)
        fixed = Hyperparameters(22, True)
        for plan in [master, *workers]:
            assert plan.settings.bucket_size == fixed.bucket_size
            assert plan.settings.hierarchical_reduce is fixed.is_hierarchical_reduce
        return
    service_port = master_port(job) + 1
    assert master.starts_service and not any(plan.starts_service for plan in workers)
    expected = f"http://{job['metadata']['name']}-master-0:{service_port}"
    assert {plan.settings.service_url for plan in [master, *workers]} == {expected}
    assert master.service_args[:4] == (
        "--host", f"{job['metadata']['name']}-master-0", "--port", str(service_port),
    )  # fmt: skip
    master_pod = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    declared = {port["containerPort"] for port in pytorch_container(master_pod)["ports"]}
    assert service_port in declared, "declare the service port (for network policies)"
    assert "--log-file" in master.service_args and "--best-file" in master.service_args
