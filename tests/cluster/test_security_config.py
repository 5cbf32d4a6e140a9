"""The security keys of the config, checked at load (cluster/security_checks.py): an
existing Ray off loopback needs TLS or token auth unless ``ray.insecure``; ``ray.tls``
comes whole and only with an address; the router's TLS pair and key file; Ray's TLS
reaches the driver's environment; a Ray found off loopback after connecting is left."""

from __future__ import annotations

import logging

import pytest

from pdserve.cluster.config_loader import ConfigError, load_config
from pdserve.cluster.security_checks import address_host, apply_ray_tls, check_connected


def _config(model: str, ray: dict | None = None, router: dict | None = None) -> dict:
    return {"model": model, "ray": ray or {}, "router": router or {}}


@pytest.fixture
def clean_env(monkeypatch):
    for name in ("RAY_USE_TLS", "RAY_AUTH_MODE"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.fixture
def pem(tmp_path):
    path = tmp_path / "x.pem"
    path.write_text("-----BEGIN CERTIFICATE-----\n")
    return str(path)


@pytest.mark.parametrize("address", ["10.1.2.3:6379", "ray://10.1.2.3:10001", "head:6379"])
def test_an_unsecured_ray_off_loopback_is_refused_unless_insecure(chat_model, clean_env, address):
    with pytest.raises(ConfigError, match="ray.address: .*not loopback.*ray.insecure: true"):
        load_config(_config(chat_model, {"address": address}))
    assert load_config(_config(chat_model, {"address": address, "insecure": True})).ray.insecure
    clean_env.setenv("RAY_AUTH_MODE", "token")
    load_config(_config(chat_model, {"address": address}))


@pytest.mark.parametrize("address", ["127.0.0.1:6379", "ray://localhost:10001", "[::1]:6379"])
def test_a_ray_on_loopback_or_auto_needs_nothing(chat_model, clean_env, address):
    load_config(_config(chat_model, {"address": address}))
    assert address_host("auto") is None


def test_ray_tls_is_whole_and_only_for_an_existing_ray(chat_model, clean_env, pem):
    tls = {"cert_file": pem, "key_file": pem, "ca_file": pem}
    with pytest.raises(ConfigError, match="ray.tls.cert_file: set with ray.address null"):
        load_config(_config(chat_model, {"tls": tls}))
    with pytest.raises(ConfigError, match="ray.tls.ca_file: missing"):
        partial = {**tls, "ca_file": None}
        load_config(_config(chat_model, {"address": "10.1.2.3:6379", "tls": partial}))
    config = load_config(_config(chat_model, {"address": "10.1.2.3:6379", "tls": tls}))
    env: dict = {}
    apply_ray_tls(config.ray, env)
    assert env == {
        "RAY_USE_TLS": "1",
        "RAY_TLS_SERVER_CERT": pem,
        "RAY_TLS_SERVER_KEY": pem,
        "RAY_TLS_CA_CERT": pem,
    }
    with pytest.raises(ConfigError, match="ray.tls.key_file: .*must be the path of a readable"):
        load_config(_config(chat_model, {"address": "auto", "tls": {**tls, "key_file": "/no"}}))


def test_the_address_ray_found_is_checked_after_connecting(chat_model, clean_env, caplog):
    ray = load_config(_config(chat_model, {"address": "auto"})).ray
    assert check_connected(ray, "127.0.0.1:6379") is None
    assert "'10.1.2.3:6379' is not loopback" in check_connected(ray, "10.1.2.3:6379")
    ray.insecure = True
    with caplog.at_level(logging.WARNING, logger="pdserve.cluster.security_checks"):
        assert check_connected(ray, "10.1.2.3:6379") is None
    assert "ray.insecure" in caplog.text
    clean_env.setenv("RAY_AUTH_MODE", "token")
    ray.insecure = False
    assert check_connected(ray, "10.1.2.3:6379") is None
    # a host given: checked at load (Ray reports its GCS at the node's address anyway)
    given = load_config(_config(chat_model, {"address": "127.0.0.1:6379"})).ray
    clean_env.delenv("RAY_AUTH_MODE")
    assert check_connected(given, "10.1.2.3:6379") is None


def test_router_tls_and_key_file(chat_model, pem, tmp_path):
    with pytest.raises(ConfigError, match="router.tls.cert_file: set without its pair"):
        load_config(_config(chat_model, router={"tls": {"cert_file": pem}}))
    with pytest.raises(ConfigError, match="router.tls.client_ca_file: mTLS needs TLS"):
        load_config(_config(chat_model, router={"tls": {"client_ca_file": pem}}))
    keys = tmp_path / "keys"
    keys.write_text("# none yet\n\n")
    with pytest.raises(ConfigError, match="router.api_key_file: no key in it"):
        load_config(_config(chat_model, router={"api_key_file": str(keys)}))
    keys.write_text("two keys on one line\n")
    with pytest.raises(ConfigError, match="line 1 holds whitespace"):
        load_config(_config(chat_model, router={"api_key_file": str(keys)}))
    with pytest.raises(ConfigError, match="router.api_key_file: '/no/keys' is not allowed"):
        load_config(_config(chat_model, router={"api_key_file": "/no/keys"}))
    with pytest.raises(ConfigError, match="router.max_body_bytes: 10 is not allowed"):
        load_config(_config(chat_model, router={"max_body_bytes": 10}))


def test_kv_transfer_tls_is_whole_and_only_for_grpc(chat_model, pem):
    kv = {"backend": "grpc", "tls": {"cert_file": pem, "key_file": pem}}
    base = {**_config(chat_model), "mode": "disaggregated", "kv_transfer": kv}
    with pytest.raises(ConfigError, match="kv_transfer.tls.ca_file: missing; the KV plane"):
        load_config(base)
    kv["tls"]["ca_file"] = pem
    load_config(base)  # whole, with grpc
    kv["backend"] = "gloo"
    with pytest.raises(ConfigError, match=r"kv_transfer.tls.cert_file: set with kv_transfer.ba"):
        load_config(base)
    kv["tls"]["ca_file"] = "/no/ca.pem"
    with pytest.raises(ConfigError, match="kv_transfer.tls.ca_file: '/no/ca.pem' is not allowed"):
        load_config(base)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "router.example"])
def test_a_router_off_loopback_authenticates_its_clients_unless_insecure(
    chat_model, pem, tmp_path, host
):
    with pytest.raises(ConfigError, match="router.host: .*not loopback.*router.insecure: true"):
        load_config(_config(chat_model, router={"host": host}))
    keys = tmp_path / "keys"
    keys.write_text("a-key\n")
    load_config(_config(chat_model, router={"host": host, "api_key_file": str(keys)}))
    mtls = {"cert_file": pem, "key_file": pem, "client_ca_file": pem}
    load_config(_config(chat_model, router={"host": host, "tls": mtls}))
    assert load_config(_config(chat_model, router={"host": host, "insecure": True})).router.insecure
    for loopback in ("127.0.0.1", "::1", "localhost"):
        load_config(_config(chat_model, router={"host": loopback}))


def test_instance_metrics_off_loopback_need_the_routers_keys_unless_insecure(
    chat_model, clean_env, tmp_path
):
    """A pool's ``metrics_port`` on an interface off loopback (its ``bind``, or the
    node's address with an existing Ray) is refused without API keys to check."""
    off = {"colocated": {"metrics_port": 9400, "bind": "0.0.0.0"}}
    with pytest.raises(ConfigError, match="colocated.metrics_port: .*'0.0.0.0', not loopback"):
        load_config({**_config(chat_model), **off})
    existing = {"address": "127.0.0.1:6379"}
    with pytest.raises(ConfigError, match="colocated.metrics_port: .*the node's Ray address"):
        load_config({**_config(chat_model, existing), "colocated": {"metrics_port": 0}})
    keys = tmp_path / "keys"
    keys.write_text("a-key\n")
    load_config({**_config(chat_model, router={"api_key_file": str(keys)}), **off})
    load_config({**_config(chat_model, router={"insecure": True}), **off})
    # an embedded Ray binds loopback; so does a pool told to
    load_config({**_config(chat_model), "colocated": {"metrics_port": 0}})
    local = {"metrics_port": 0, "bind": "127.0.0.1"}
    load_config({**_config(chat_model, existing), "colocated": local})
    with pytest.raises(ConfigError, match="colocated.metrics_port: 70000 is not allowed"):
        load_config({**_config(chat_model), "colocated": {"metrics_port": 70000}})
