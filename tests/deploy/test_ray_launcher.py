"""deploy/ray-cluster.yaml, the Ray cluster launcher's config for VMs: valid against the
launcher schema shipped in the installed Ray (``ray/autoscaler/ray-schema.json``) and
through Ray's own offline check (defaults filled, then validated); its node types offer
the labels and custom resources of configs/vm.yaml's pools; the files it mounts and the
commands it runs exist. docs/deploy.md, "On VMs with ray up"."""

from __future__ import annotations

import json
import re
import subprocess
import tomllib
from pathlib import Path

import jsonschema
import pytest
import ray
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from tests.deploy.manifests import DEPLOY, ROOT, command_flags

COVERS = ("ray-cluster.yaml", "configs/vm.yaml")
LAUNCHER = DEPLOY / "ray-cluster.yaml"


def launcher() -> dict:
    return yaml.safe_load(LAUNCHER.read_text())


def vm_config() -> dict:
    return yaml.safe_load((DEPLOY / "configs" / "vm.yaml").read_text())


@pytest.fixture(scope="module")
def schema() -> dict:
    return json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())


def test_matches_rays_launcher_schema(schema):
    jsonschema.validate(launcher(), schema)
    validate_config(prepare_config(launcher()))


def test_a_wrong_type_fails(schema):
    config = launcher()
    config["available_node_types"]["prefill"]["resources"]["pool_prefill"] = "two"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(config, schema)
    config = launcher()
    del config["available_node_types"]["decode"]["node_config"]
    with pytest.raises(jsonschema.ValidationError):
        validate_config(prepare_config(config))


def test_node_types_offer_what_the_pools_ask():
    types = launcher()["available_node_types"]
    config = vm_config()
    for role in ("prefill", "decode"):
        pool = config[role]
        matching = [t for t in types.values() if pool["node_labels"].items() <= t["labels"].items()]
        assert len(matching) == 1, f"{role}: {len(matching)} node types carry its labels"
        (node,) = matching
        custom = pool["resources"]["custom"]
        per_node = min(node["resources"].get(k, 0) // v for k, v in custom.items())
        assert per_node >= 1
        assert node["resources"]["CPU"] >= per_node * pool["resources"]["num_cpus"]
        assert pool["instances"] <= per_node * node["max_workers"]
    head = types[launcher()["head_node_type"]]
    assert head["resources"]["CPU"] == 0, "the head runs the router only"


def test_mounted_files_and_commands_exist():
    config = launcher()
    assert config["file_mounts"]["~/pdserve"] == ".", "ray up runs from the repository root"
    setup = " ".join(config["setup_commands"])
    assert "bash scripts/setup.sh" in setup and (ROOT / "scripts" / "setup.sh").exists()
    head = config["head_start_ray_commands"]
    up = next(c for c in head if "pdserve up" in c)
    path = re.search(r"pdserve up (\S+)", up).group(1)
    assert path.startswith("~/pdserve/") and (ROOT / path.removeprefix("~/pdserve/")).exists()
    secrets = config["file_mounts"]["~/pdserve-secrets"]
    vm = vm_config()
    for path in (vm["router"]["api_key_file"], vm["kv_transfer"]["secret_file"]):
        assert path.startswith("~/pdserve-secrets/"), f"{path} is not in the mounted secrets"
    assert secrets.startswith("~/"), "secrets come from the user's machine, never the repo"


def test_ray_is_the_projects_and_joins_with_a_token():
    pinned = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    ray_pin = next(d for d in pinned if d.startswith("ray=="))
    config = launcher()
    assert f'"ray[default]=={ray_pin.partition("==")[2]}"' in " ".join(config["setup_commands"])
    for command in config["head_start_ray_commands"] + config["worker_start_ray_commands"]:
        if "ray start" in command or "pdserve up" in command:
            assert "RAY_AUTH_MODE=token" in command, command
        if "ray start" in command:  # its workers at the node's niceness, not 15
            assert "RAY_worker_niceness=0" in command, command
    start = next(c for c in config["worker_start_ray_commands"] if "ray start" in c)
    assert command_flags(start.partition("ray start")[2])["address"] == "$RAY_HEAD_IP:6379"


def test_commands_are_valid_shell():
    config = launcher()
    keys = ("initialization_commands", "setup_commands", "head_setup_commands")
    keys += ("head_start_ray_commands", "worker_start_ray_commands")
    for key in keys:
        for command in config[key]:
            check = subprocess.run(["bash", "-n", "-c", command], capture_output=True, text=True)
            assert check.returncode == 0, f"{key}: {command}: {check.stderr}"


def test_no_secret_in_the_config():
    text = LAUNCHER.read_text() + (DEPLOY / "configs" / "vm.yaml").read_text()
    assert not re.search(r"[0-9a-f]{32}", text), "a token or key is written in the config"
