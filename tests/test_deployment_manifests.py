"""The Kubernetes manifests in docs/kubernetes/ (docs/deployment.md): each parses, and what they share agrees: the
front end's --engine addresses name the engine StatefulSet's pods, Services select pods that exist, secret items
are the files `zmq.auth.create_certificates` writes, every tokenmill command line parses with the real CLI, the
KubeRay worker pods hold the replicas the head's front end asks for, and the Ray version is the pinned one."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import click
import pytest

from tokenmill.cli import main

yaml = pytest.importorskip("yaml")

REPO = Path(__file__).resolve().parents[1]
MANIFESTS = REPO / "docs" / "kubernetes"
IMAGE = "tokenmill:0.1.0"
CERTIFICATE_FILES = {"engine.key", "engine.key_secret", "frontend.key", "frontend.key_secret"}


def _documents(name: str) -> dict[tuple[str, str], dict[str, Any]]:
    documents = [doc for doc in yaml.safe_load_all((MANIFESTS / name).read_text()) if doc is not None]
    for doc in documents:
        assert {"apiVersion", "kind", "metadata"} <= set(doc) and doc["metadata"]["name"], doc
    by_kind = {(doc["kind"], doc["metadata"]["name"]): doc for doc in documents}
    assert len(by_kind) == len(documents), f"{name}: two objects share a kind and name"
    return by_kind


def _parse(command: list[str]) -> dict[str, Any]:
    """``tokenmill SUBCOMMAND ARGS`` parsed by the real CLI (nothing runs): its parameters, or a usage error."""
    assert command[0] == "tokenmill", command
    subcommand = main.commands[command[1]]
    context = subcommand.make_context(command[1], command[2:])
    return dict(context.params)


def _container(workload: dict[str, Any]) -> dict[str, Any]:
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    return container


def test_every_manifest_parses() -> None:
    names = sorted(path.name for path in MANIFESTS.glob("*.yaml"))
    assert names == ["tokenmill-engines.yaml", "tokenmill-raycluster.yaml"]
    for name in names:
        _documents(name)


def test_engines_manifest_wires_the_front_end_to_every_engine_pod() -> None:
    objects = _documents("tokenmill-engines.yaml")
    engines = objects["StatefulSet", "tokenmill-engine"]
    frontend = objects["Deployment", "tokenmill-frontend"]
    headless = objects["Service", engines["spec"]["serviceName"]]
    assert headless["spec"]["clusterIP"] == "None"

    engine, front = _container(engines), _container(frontend)
    assert engine["image"] == front["image"] == IMAGE
    engine_params = _parse([*engine["command"], *engine["args"]])
    port = int(engine_params["listen"].rsplit(":", 1)[1])
    assert engine["ports"][0]["containerPort"] == port and headless["spec"]["ports"][0]["port"] == port
    front_params = _parse([*front["command"], *front["args"]])
    expected = [f"tcp://{engines['metadata']['name']}-{index}.{headless['metadata']['name']}:{port}"
                for index in range(engines["spec"]["replicas"])]  # fmt: skip
    assert list(front_params["cfg__server__engines"]) == expected

    # Each Service selects the pods of a workload here.
    for (kind, _), service in objects.items():
        if kind == "Service":
            selector = service["spec"]["selector"].items()
            assert any(selector <= workload["spec"]["template"]["metadata"]["labels"].items()
                       for workload in (engines, frontend)), service  # fmt: skip

    # The CURVE flags point at files mounted from the secret, each the certificate file it must be.
    def mounted(container: dict[str, Any], workload: dict[str, Any]) -> dict[str, str]:
        volumes = {volume["name"]: volume for volume in workload["spec"]["template"]["spec"]["volumes"]}
        files = {}
        for mount in container["volumeMounts"]:
            for item in volumes[mount["name"]]["secret"]["items"]:
                assert item["key"] in CERTIFICATE_FILES
                files[f"{mount['mountPath']}/{item['path']}"] = item["key"]
        return files

    engine_files, front_files = mounted(engine, engines), mounted(front, frontend)
    assert engine_files[engine_params["cfg__transport__curve_secret_key_file"]] == "engine.key_secret"
    allowed = engine_params["cfg__transport__curve_public_keys_dir"]
    assert [key for path, key in engine_files.items() if path.startswith(allowed + "/")] == ["frontend.key"]
    assert front_files[front_params["cfg__transport__curve_secret_key_file"]] == "frontend.key_secret"
    assert front_files[front_params["cfg__transport__curve_engine_public_key_file"]] == "engine.key"
    assert "frontend.key_secret" not in engine_files.values() and "engine.key_secret" not in front_files.values()


def test_raycluster_manifest_places_the_replicas_its_front_end_asks_for() -> None:
    objects = _documents("tokenmill-raycluster.yaml")
    (cluster,) = [doc for (kind, _), doc in objects.items() if kind == "RayCluster"]
    assert cluster["apiVersion"] == "ray.io/v1"
    assert cluster["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    pinned = re.search(r"^ray==(\S+)$", (REPO / "constraints.txt").read_text(), re.MULTILINE)
    assert pinned is not None and cluster["spec"]["rayVersion"] == pinned.group(1)

    head = cluster["spec"]["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    (head_container,) = head["template"]["spec"]["containers"]
    script = head_container["args"][0]
    assert "$KUBERAY_GEN_RAY_START_CMD" in script
    serve = shlex.split(script.split("exec ", 1)[1])
    params = _parse(serve)
    assert params["cfg__server__backend"] == "ray"
    num_replicas = params["cfg__server__data_parallel_size"]
    cpus_per_replica = params["cfg__server__ray_num_cpus_per_replica"]
    (workers,) = cluster["spec"]["workerGroupSpecs"]
    num_cpus = float(workers["rayStartParams"]["num-cpus"])
    assert workers["minReplicas"] * (num_cpus // cpus_per_replica) >= num_replicas  # every replica has a place
    for group in (head["template"], workers["template"]):
        for container in group["spec"]["containers"]:
            assert container["image"] == IMAGE
            assert container["command"] == ["/bin/bash", "-lc", "--"] and "ulimit -n" in container["args"][0]
    (worker_container,) = workers["template"]["spec"]["containers"]
    assert "$KUBERAY_GEN_RAY_START_CMD" in worker_container["args"][0]

    service = objects["Service", "tokenmill"]
    assert service["spec"]["selector"] == {"ray.io/cluster": cluster["metadata"]["name"], "ray.io/node-type": "head"}
    port = params["cfg__server__port"]
    assert service["spec"]["ports"][0]["targetPort"] == port
    assert port in [p["containerPort"] for p in head_container["ports"]]


def test_a_misspelled_flag_would_fail_the_parse() -> None:
    with pytest.raises(click.UsageError):
        _parse(["tokenmill", "serve", "--backend", "ray", "--ray-num-cpu-per-replica", "2"])


def test_the_dockerfile_builds_the_image_the_manifests_run() -> None:
    dockerfile = (MANIFESTS / "Dockerfile").read_text()
    assert f"-t {IMAGE} ." in dockerfile and '".[ray]"' in dockerfile and "tokenmill pull" in dockerfile
