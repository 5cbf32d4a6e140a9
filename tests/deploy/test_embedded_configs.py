"""The pdserve configs that deploy/ embeds (the ConfigMaps' ``config.yaml``, the VM
cluster's configs/vm.yaml) load with ``cluster.config_loader.load_config``, security
checks included, given the secret files they name: stand-ins in a temporary folder for
the files Kubernetes or the launcher would mount. docs/deploy.md."""

from __future__ import annotations

import secrets

import pytest
import yaml

from pdserve.cluster.config_loader import ConfigError, load_config
from pdserve.cluster.security_checks import is_loopback
from tests.deploy.manifests import DEPLOY, VARIANTS, embedded_config

COVERS = (*(f"kuberay/configmap-{v}.yaml" for v in VARIANTS), "configs/vm.yaml")
CONFIGS = [f"configmap-{v}" for v in VARIANTS] + ["vm"]


def raw_config(name: str) -> dict:
    if name == "vm":
        return yaml.safe_load((DEPLOY / "configs" / "vm.yaml").read_text())
    return embedded_config(name.removeprefix("configmap-"))


def with_stand_ins(raw: dict, tmp_path) -> dict:
    """``raw`` with each secret file it names replaced by a stand-in holding what the
    mounted file would: API keys one a line, a KV secret of 32 random bytes (hex)."""
    raw = yaml.safe_load(yaml.safe_dump(raw))
    keys = tmp_path / "api_keys"
    keys.write_text(f"{secrets.token_hex(24)}\n")
    kv = tmp_path / "kv_secret"
    kv.write_text(secrets.token_hex(32))
    assert raw["router"].get("api_key_file"), "the router must name its API key file"
    raw["router"]["api_key_file"] = str(keys)
    if raw.get("kv_transfer", {}).get("secret_file"):
        raw["kv_transfer"]["secret_file"] = str(kv)
    return raw


@pytest.mark.parametrize("name", CONFIGS)
def test_config_loads_with_its_secret_files(name, tmp_path):
    config = load_config(with_stand_ins(raw_config(name), tmp_path))
    assert config.mode == "disaggregated"
    assert config.ray.address == "auto"
    for role, pool in config.pools().items():
        assert pool.resources.custom, f"{role}: no custom resource ties it to its nodes"
        assert pool.node_labels == {"pool": role}


@pytest.mark.parametrize("name", CONFIGS)
def test_router_off_loopback_is_closed(name):
    """A router every pod or VM can reach authenticates its clients: without its key
    file the config is refused (cluster/security_checks.py)."""
    raw = raw_config(name)
    assert not is_loopback(raw["router"]["host"])
    del raw["router"]["api_key_file"]
    with pytest.raises(ConfigError, match="router.host: .*not loopback"):
        load_config(raw)


@pytest.mark.parametrize("name", CONFIGS)
def test_an_empty_key_file_is_refused(name, tmp_path):
    """The security checks run on these configs: a key file with no key fails the load."""
    raw = with_stand_ins(raw_config(name), tmp_path)
    (tmp_path / "api_keys").write_text("# no key\n")
    with pytest.raises(ConfigError, match="router.api_key_file"):
        load_config(raw)
