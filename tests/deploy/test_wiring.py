"""The KubeRay manifests agree with each other and with the pdserve config they embed
(docs/deploy.md, "Where the router runs"): each pool's node labels and custom resources
are offered by exactly one worker group, with room for every rank; the RayJob's driver
can only land on the router pod, which mounts the config and secret files the config
names; the Service and the probes use the router's ports."""

from __future__ import annotations

import json
import shlex
import subprocess

import pytest

from tests.deploy.manifests import (
    KUBERAY,
    VARIANTS,
    command_flags,
    cpu_quantity,
    embedded_config,
    one,
    start_labels,
    start_resources,
)

COVERS = (
    "kuberay/router.yaml",
    "kuberay/rayjob.yaml",
    *(f"kuberay/raycluster-{v}.yaml" for v in VARIANTS),
    *(f"kuberay/configmap-{v}.yaml" for v in VARIANTS),
)


def cluster(variant: str) -> dict:
    return one(KUBERAY / f"raycluster-{variant}.yaml", "RayCluster")


def router_container() -> dict:
    deployment = one(KUBERAY / "router.yaml", "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def router_ray_start() -> dict[str, str]:
    """The flags of the router pod's ``ray start`` (after its wait for the GCS)."""
    script = " ".join(router_container()["args"])
    return command_flags(script.partition("exec ray start")[2])


@pytest.mark.parametrize("variant", VARIANTS)
def test_each_pool_fits_its_worker_group(variant):
    config = embedded_config(variant)
    groups = cluster(variant)["spec"]["workerGroupSpecs"]
    for role in ("prefill", "decode"):
        pool = config[role]
        wanted = pool["node_labels"]
        matching = [
            g for g in groups if wanted.items() <= start_labels(g["rayStartParams"]).items()
        ]
        assert len(matching) == 1, f"{variant} {role}: {len(matching)} groups carry {wanted}"
        (group,) = matching
        offered = start_resources(group["rayStartParams"])
        need = pool["resources"]
        ranks_per_pod = min(offered.get(k, 0) // v for k, v in need["custom"].items())
        assert ranks_per_pod >= 1, f"{variant} {role}: no pod offers {need['custom']}"
        ranks = pool["instances"] * pool.get("tensor_parallel", 1)
        assert ranks <= ranks_per_pod * group["maxReplicas"]
        assert group["replicas"] * ranks_per_pod >= ranks, f"{variant} {role}: too few pods"
        (container,) = group["template"]["spec"]["containers"]
        limits = container["resources"]["limits"]
        assert cpu_quantity(limits["cpu"]) >= ranks_per_pod * need["num_cpus"]
        assert int(limits.get("nvidia.com/gpu", 0)) >= ranks_per_pod * need.get("num_gpus", 0)
    for group in groups:  # no pool's resource is offered where its labels are not
        labels = start_labels(group["rayStartParams"])
        for resource in start_resources(group["rayStartParams"]):
            role = resource.removeprefix("pool_")
            assert labels.get("pool") == role, f"{group['groupName']} offers {resource}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_head_takes_no_instance(variant):
    head = cluster(variant)["spec"]["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    assert start_resources(head["rayStartParams"]) == {}


def test_only_the_router_pod_can_run_the_driver():
    job = one(KUBERAY / "rayjob.yaml", "RayJob")["spec"]
    wanted = json.loads(job["entrypointResources"])
    flags = router_ray_start()
    assert json.loads(flags["resources"]) == wanted
    assert flags["num-cpus"] == "0"
    for variant in VARIANTS:
        spec = cluster(variant)["spec"]
        for params in [spec["headGroupSpec"]["rayStartParams"]] + [
            g["rayStartParams"] for g in spec["workerGroupSpecs"]
        ]:
            assert not wanted.keys() & start_resources(params).keys()


def test_the_router_pods_command_is_valid_shell():
    container = router_container()
    assert container["command"] == ["/bin/bash", "-c"]
    (script,) = container["args"]
    check = subprocess.run(["bash", "-n", "-c", script], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr


def test_the_job_and_the_router_pod_join_the_cluster():
    job = one(KUBERAY / "rayjob.yaml", "RayJob")["spec"]
    names = {cluster(v)["metadata"]["name"] for v in VARIANTS}
    assert names == {job["clusterSelector"]["ray.io/cluster"]}
    (name,) = names
    # KubeRay names the head's Service <cluster>-head-svc; GCS on 6379
    assert router_ray_start()["address"] == f"{name}-head-svc:6379"


def test_the_router_pod_mounts_what_the_config_names():
    job = one(KUBERAY / "rayjob.yaml", "RayJob")["spec"]
    command = shlex.split(job["entrypoint"])
    assert command[:2] == ["pdserve", "up"]
    mounts = {m["mountPath"]: m for m in router_container()["volumeMounts"]}
    deployment = one(KUBERAY / "router.yaml", "Deployment")
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    config_mount = mounts[command[2]]
    assert volumes[config_mount["name"]]["configMap"]["name"] == "pdserve-config"
    assert config_mount["subPath"] == "config.yaml"
    for variant in VARIANTS:
        assert one(KUBERAY / f"configmap-{variant}.yaml", "ConfigMap")["metadata"]["name"] == (
            "pdserve-config"
        )
        config = embedded_config(variant)
        for path in (config["router"]["api_key_file"], config["kv_transfer"]["secret_file"]):
            folder, _, file = path.rpartition("/")
            secret = volumes[mounts[folder]["name"]]["secret"]
            assert file in {item["path"] for item in secret["items"]}, path


@pytest.mark.parametrize("variant", VARIANTS)
def test_service_and_probes_use_the_router_ports(variant):
    router = embedded_config(variant)["router"]
    service = one(KUBERAY / "router.yaml", "Service")
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert ports["grpc"]["port"] == router["port"]
    assert ports["http"]["port"] == router["http_port"]
    container = router_container()
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert named == {"grpc": router["port"], "http": router["http_port"]}
    assert container["startupProbe"]["grpc"]["port"] == router["port"]
    assert container["readinessProbe"]["grpc"]["port"] == router["port"]
    assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": router["http_port"]}
    deployment = one(KUBERAY / "router.yaml", "Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()


def test_probes_leave_the_router_time_to_start():
    """The startup probe allows at least 10 min before liveness may restart the pod, and
    liveness waits longer than a supervisor restart before it does."""
    container = router_container()
    startup, liveness = container["startupProbe"], container["livenessProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600
    assert liveness["periodSeconds"] * liveness["failureThreshold"] >= 120


def ray_node_containers() -> list[dict]:
    """Every container that runs ``ray start``: the router pod's, and each cluster
    variant's head and worker groups'."""
    containers = [router_container()]
    for variant in VARIANTS:
        spec = cluster(variant)["spec"]
        for template in [spec["headGroupSpec"]["template"]] + [
            g["template"] for g in spec["workerGroupSpecs"]
        ]:
            containers += template["spec"]["containers"]
    return containers


def test_every_ray_node_starts_its_workers_at_niceness_0():
    """Not Ray's default of 15: the workers are the service (docs/serving.md, "Worker
    niceness")."""
    for container in ray_node_containers():
        env = {e["name"]: e for e in container["env"]}
        assert env["RAY_worker_niceness"]["value"] == "0", container["name"]


def test_every_ray_container_has_the_clusters_token():
    """Ray's token authentication on every Ray process: all take the same Secret key."""
    job = one(KUBERAY / "rayjob.yaml", "RayJob")["spec"]
    containers = ray_node_containers() + job["submitterPodTemplate"]["spec"]["containers"]
    for container in containers:
        env = {e["name"]: e for e in container["env"]}
        assert env["RAY_AUTH_MODE"]["value"] == "token", container["name"]
        assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {
            "name": "pdserve-secrets",
            "key": "ray_token",
        }
