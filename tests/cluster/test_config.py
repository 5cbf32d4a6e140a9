"""The YAML schema: broken files fail at load, naming the key, before any Ray starts."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import ray

from pdserve.cluster import ClusterConfig, ConfigError, launch, load_config
from tests.cluster.helpers import ray_temp_dirs

ROOT = Path(__file__).resolve().parents[2]

# (case, YAML with MODEL standing for the tiny model's folder, the key the error names)
BROKEN = [
    ("unknown top-level key", "model: MODEL\nmodle: x\n", "modle"),
    ("unknown nested key", "model: MODEL\nrouter: {polcy: round_robin}\n", "router.polcy"),
    (
        "unknown key in resources",
        "model: MODEL\ncolocated: {resources: {cpus: 1}}\n",
        "colocated.resources.cpus",
    ),
    (
        "wrong type: string for int",
        "model: MODEL\ncolocated: {instances: two}\n",
        "colocated.instances",
    ),
    ("wrong type: bool for int", "model: MODEL\nrouter: {port: true}\n", "router.port"),
    ("wrong type: list for section", "model: MODEL\nrouter: [1, 2]\n", "router"),
    ("wrong type: null model", "model: null\n", "model"),
    ("negative instances", "model: MODEL\ncolocated: {instances: -1}\n", "colocated.instances"),
    (
        "zero instances of the active pool",
        "model: MODEL\ncolocated: {instances: 0}\n",
        "colocated.instances",
    ),
    ("missing model", "colocated: {instances: 2}\n", "model"),
    ("model not found", "model: /no/such/model\n", "model"),
    ("unknown policy", "model: MODEL\nrouter: {policy: random}\n", "router.policy"),
    ("port out of range", "model: MODEL\nrouter: {port: 70000}\n", "router.port"),
    ("negative queue", "model: MODEL\nrouter: {max_queue: -1}\n", "router.max_queue"),
    (
        "zero queue timeout",
        "model: MODEL\nrouter: {queue_timeout_s: 0}\n",
        "router.queue_timeout_s",
    ),
    (
        "zero stall timeout",
        "model: MODEL\nrouter: {stall_timeout_s: 0}\n",
        "router.stall_timeout_s",
    ),
    (
        "no concurrent requests",
        "model: MODEL\nrouter: {max_concurrent_requests: 0}\n",
        "router.max_concurrent_requests",
    ),
    ("unknown mode", "model: MODEL\nmode: pipelined\n", "mode"),
    ("unknown kv backend", "model: MODEL\nkv_transfer: {backend: mpi}\n", "kv_transfer.backend"),
    ("attainment above 1", "model: MODEL\nslo: {attainment: 1.5}\n", "slo.attainment"),
    ("unknown dtype", "model: MODEL\ndtype: int8\n", "dtype"),
    (
        "tensor_parallel not dividing heads",
        "model: MODEL\ncolocated: {tensor_parallel: 3}\n",
        "colocated.tensor_parallel",
    ),
    (
        "more CPUs than the machine",
        "model: MODEL\ncolocated: {resources: {num_cpus: 4096}}\n",
        "colocated.resources.num_cpus",
    ),
    (
        "more GPUs than the machine",
        "model: MODEL\ncolocated: {resources: {num_gpus: 64}}\n",
        "colocated.resources.num_gpus",
    ),
    (
        "node labels on the embedded Ray",
        "model: MODEL\ncolocated: {node_labels: {pool: colocated}}\n",
        "colocated.node_labels",
    ),
    (
        "custom resources on the embedded Ray",
        "model: MODEL\ncolocated: {resources: {custom: {pool_a: 1}}}\n",
        "colocated.resources.custom",
    ),
    (
        "a rank that reserves nothing",
        "model: MODEL\ncolocated: {resources: {num_cpus: 0}}\n",
        "colocated.resources.num_cpus",
    ),
]


def write(tmp_path: Path, text: str, model: str) -> Path:
    path = tmp_path / "cluster.yaml"
    path.write_text(text.replace("MODEL", model))
    return path


@pytest.mark.parametrize("case,text,key", BROKEN, ids=[c[0] for c in BROKEN])
def test_broken_yaml_names_the_key_and_starts_no_ray(
    tmp_path, monkeypatch, chat_model, case, text, key
):
    path = write(tmp_path, text, chat_model)
    monkeypatch.setenv("PDSERVE_RAY_TMPDIR", str(tmp_path))
    with pytest.raises(ConfigError) as err:
        launch(path)
    assert err.value.key == key
    assert str(err.value).startswith(f"{key}: ")
    assert not ray.is_initialized() and ray_temp_dirs(tmp_path) == []


def test_messages_name_value_and_what_is_allowed(chat_model):
    def message(raw):
        with pytest.raises(ConfigError) as err:
            load_config({"model": chat_model, **raw})
        return str(err.value)

    assert message({"colocated": {"instances": -1}}) == (
        "colocated.instances: -1 is not allowed; must be >= 0"
    )
    assert "'two' is a string; expected an integer" in message({"colocated": {"instances": "two"}})
    assert "allowed keys here are host, port" in message({"router": {"polcy": 1}})
    assert "allowed values are round_robin, least_loaded, cache_aware" in message(
        {"router": {"policy": "x"}}
    )
    assert "allowed: 1, 2" in message({"colocated": {"tensor_parallel": 3}})
    assert message({"router": {"queue_timeout_s": float("inf")}}) == (
        "router.queue_timeout_s: inf is not allowed; must be a positive finite number of seconds"
    )
    assert message({"router": {"max_concurrent_requests": 0}}) == (
        "router.max_concurrent_requests: 0 is not allowed; must be >= 1"
    )
    assert message({"router": {"max_concurrent_requests_per_address": 0}}) == (
        "router.max_concurrent_requests_per_address: 0 is not allowed; must be >= 1"
    )
    for key in ("header_timeout_s", "body_timeout_s", "write_timeout_s"):
        assert message({"router": {key: 0}}) == (
            f"router.{key}: 0.0 is not allowed; must be a positive finite number of seconds"
        )
    assert message({"router": {"max_request_id_chars": 0}}) == (
        "router.max_request_id_chars: 0 is not allowed; must be >= 1"
    )


def test_placement_keys_are_checked_naming_the_key(chat_model):
    """``<pool>.resources.custom`` and ``<pool>.node_labels``: mappings of names to
    amounts / label values, for an existing Ray (docs/serving.md, "Running across nodes")."""
    on_ray = {"model": chat_model, "mode": "disaggregated", "ray": {"address": "127.0.0.2:6379"}}

    def message(**pools):
        with pytest.raises(ConfigError) as err:
            load_config({**on_ray, **pools})
        return str(err.value)

    config = load_config({**on_ray, "prefill": {
        "resources": {"num_cpus": 0, "custom": {"pool_prefill": 1}},
        "node_labels": {"pool": "prefill", "example.com/zone": "a-1"}}})  # fmt: skip
    assert config.prefill.resources.custom == {"pool_prefill": 1.0}
    assert config.prefill.node_labels == {"pool": "prefill", "example.com/zone": "a-1"}
    assert config.decode.resources.custom == {} and config.decode.node_labels == {}
    assert load_config(config).prefill.node_labels == config.prefill.node_labels  # round trip

    assert message(decode={"node_labels": {"zone": 1}}) == (
        "decode.node_labels.zone: 1 is a integer; expected a string"
    )
    assert message(decode={"node_labels": ["pool=decode"]}) == (
        'decode.node_labels: ["pool=decode"] is a list; expected a mapping of a string to a string'
    )
    assert message(decode={"resources": {"custom": {"pool_decode": "one"}}}) == (
        "decode.resources.custom.pool_decode: 'one' is a string; expected a number"
    )
    for name in ("CPU", "GPU", "memory", "node:127.0.0.1"):
        text = message(decode={"resources": {"custom": {name: 1}}})
        assert text.startswith("decode.resources.custom: ") and f"{name!r} is not a custom" in text
    assert "pool_decode: 0 must be > 0" in message(
        decode={"resources": {"custom": {"pool_decode": 0}}}
    )
    assert "'bad key' is not a label key" in message(decode={"node_labels": {"bad key": "x"}})
    assert "pool: '-x' is not a label value" in message(decode={"node_labels": {"pool": "-x"}})


def test_invalid_yaml_syntax(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(path)


def test_every_design_key_is_accepted(tmp_path, chat_model):
    text = f"""
    model: {chat_model}
    mode: disaggregated
    ray: {{address: null}}
    router: {{host: 127.0.0.1, port: 50051, http_port: 8000, policy: least_loaded, max_queue: 1024}}
    prefill: {{instances: 1, tensor_parallel: 1, max_batch_tokens: 512, resources: {{num_cpus: 1}}}}
    decode:  {{instances: 1, tensor_parallel: 1, max_batch_size: 64, kv_blocks: 2048, block_size: 16, resources: {{num_cpus: 1}}}}
    colocated: {{instances: 2, tensor_parallel: 1, max_batch_tokens: 512, resources: {{num_cpus: 1}}}}
    kv_transfer: {{backend: gloo, layerwise: true, lease_s: 30}}
    slo: {{ttft_ms: 1000, tpot_ms: 150, attainment: 0.9}}
    """  # noqa: E501
    config = load_config(write(tmp_path, textwrap.dedent(text), chat_model))
    assert isinstance(config, ClusterConfig)
    assert config.mode == "disaggregated" and set(config.pools()) == {"prefill", "decode"}
    assert config.kv_transfer.lease_s == 30.0 and config.decode.kv_blocks == 2048
    assert config.colocated.instances == 2 and config.slo.attainment == 0.9


def test_set_overrides(tmp_path, chat_model):
    path = write(tmp_path, "model: MODEL\n", chat_model)
    config = load_config(
        path, ["router.port=0", "colocated.resources.num_cpus=0.5", "ray.address=null"]
    )
    assert config.router.port == 0 and config.colocated.resources.num_cpus == 0.5
    assert config.colocated.instances == 2  # the pool's own default survives a partial override
    with pytest.raises(ConfigError) as err:
        load_config(path, ["router.polcy=x"])
    assert err.value.key == "router.polcy"
    with pytest.raises(ConfigError, match="key.sub=value"):
        load_config(path, ["router.port"])


def test_shipped_configs_are_valid():
    config = load_config(ROOT / "configs" / "local-colocated.yaml")
    assert config.mode == "colocated" and config.colocated.instances == 2
    assert config.colocated.resources.num_cpus == 1
    config = load_config(ROOT / "configs" / "local-disagg.yaml")
    assert config.mode == "disaggregated"
    assert (config.prefill.instances, config.decode.instances) == (1, 1)
    assert config.kv_transfer.backend == "gloo" and config.kv_transfer.layerwise
    config = load_config(ROOT / "configs" / "local-hybrid.yaml")
    assert config.mode == "hybrid" and set(config.pools()) == {"prefill", "decode"}
    assert config.router.prefill_ms_per_token == 1.0
    with pytest.raises(ConfigError, match="must be > 0"):
        load_config(ROOT / "configs" / "local-hybrid.yaml", ["router.transfer_mb_per_s=0"])
    config = load_config(ROOT / "configs" / "local-hybrid-peers.yaml")
    assert config.mode == "hybrid"
    assert (config.prefill.instances, config.decode.instances) == (0, 2)


@pytest.mark.parametrize(
    "overrides,key,needle",
    [
        (["decode.instances=1"], "decode.instances", "at least 2 are needed"),
        (["decode.tensor_parallel=2"], "decode.tensor_parallel", "tensor_parallel 1 only"),
        (["mode=disaggregated"], "prefill.instances", "at least 1 instance"),
    ],
)
def test_hybrid_without_a_prefill_pool_needs_peers_of_one_rank(overrides, key, needle):
    path = ROOT / "configs" / "local-hybrid-peers.yaml"
    with pytest.raises(ConfigError, match=needle) as err:
        load_config(path, ["ray.address=auto", *overrides])
    assert err.value.key == key


@pytest.mark.parametrize(
    "overrides,key,needle",
    [
        (["decode.block_size=32"], "decode.block_size", "same size"),
        (["kv_transfer.backend=nccl"], "kv_transfer.backend", "num_gpus is 0"),
        (["kv_transfer.backend=tcp"], "kv_transfer.backend", "gloo, nccl, grpc"),
        (["kv_transfer.lease_s=0"], "kv_transfer.lease_s", "> 0"),
    ],
)
def test_disaggregated_kv_transfer_checks(tmp_path, chat_model, overrides, key, needle):
    path = write(tmp_path, "model: MODEL\nmode: disaggregated\n", chat_model)
    with pytest.raises(ConfigError, match=needle) as err:
        load_config(path, ["ray.address=auto", *overrides])
    assert err.value.key == key


def test_pdserve_up_reports_a_broken_config(tmp_path, chat_model):
    path = write(tmp_path, "model: MODEL\nrouter: {polcy: x}\n", chat_model)
    run = subprocess.run(
        [sys.executable, "-m", "pdserve.cluster.cli", "up", str(path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert run.returncode == 2
    assert "router.polcy: unknown key" in run.stderr


def test_an_unknown_architecture_fails_before_ray_naming_the_families(
    tmp_path, monkeypatch, chat_model
):
    """launch() and ``pdserve up`` on a model folder of an architecture the engine does
    not serve: a ConfigError on ``model`` naming the supported ones, and no Ray; a
    supported one with a RoPE scaling the engine does not compute likewise."""
    import json
    import shutil

    from pdserve.engine.families import SUPPORTED_ARCHITECTURES

    folder = tmp_path / "mixtral"
    shutil.copytree(chat_model, folder)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["MixtralForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    path = write(tmp_path, "model: MODEL\n", str(folder))
    monkeypatch.setenv("PDSERVE_RAY_TMPDIR", str(tmp_path))
    with pytest.raises(ConfigError) as err:
        launch(path)
    assert err.value.key == "model"
    assert "architectures='MixtralForCausalLM'" in str(err.value)
    assert all(arch in str(err.value) for arch in SUPPORTED_ARCHITECTURES)
    assert not ray.is_initialized() and ray_temp_dirs(tmp_path) == []
    run = subprocess.run(
        [sys.executable, "-m", "pdserve.cluster.cli", "up", str(path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert run.returncode == 2
    assert "model: " in run.stderr and "Qwen3ForCausalLM" in run.stderr
    config["architectures"] = ["Phi3ForCausalLM"]
    config.pop("rope_parameters", None)
    config["rope_scaling"] = {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="rope_type='longrope': supported are default"):
        load_config(path)
