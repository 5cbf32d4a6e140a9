"""``pdserve plan`` end to end: a 13B model on 8 A100s, ShareGPT lengths; the config it
writes loads, and it says why the winner wins."""

import json
import time

import yaml

from pdserve.cluster.cli import main
from pdserve.cluster.config_loader import load_config
from pdserve.planner.cluster_spec import ClusterSpec, PoolSpec

OPT_13B = {
    "model_type": "opt",
    "num_attention_heads": 40,
    "hidden_size": 5120,
    "ffn_dim": 20480,
    "num_hidden_layers": 40,
    "vocab_size": 50272,
    "max_position_embeddings": 2048,
}


def test_plan_opt13b_on_8_a100(tmp_path, capsys):
    folder = tmp_path / "opt-13b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(OPT_13B))
    out = tmp_path / "plan.yaml"
    started = time.monotonic()
    rc = main(
        [
            "plan",
            "--model",
            "opt-13b",
            "--devices",
            "8",
            "--workload",
            "sharegpt",
            "--slo-ttft-ms",
            "400",
            "--slo-tpot-ms",
            "100",
            "--hardware",
            "a100",
            "--samples",
            "150",
            "--duration",
            "30",
            "--verify",
            "2",
            "--serve-model",
            str(folder),
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    assert time.monotonic() - started < 60
    text = capsys.readouterr().out
    assert "winner:" in text and "limited by:" in text and "breaks first" in text
    assert "best " in text  # the other mode's best, and what limits it
    config = load_config(out)
    raw = yaml.safe_load(out.read_text())
    devices = sum(p.instances * p.tensor_parallel for p in config.pools().values())
    assert devices <= 8 and config.mode == raw["mode"]
    assert all(p.resources.num_gpus == 1 for p in config.pools().values())


def test_written_disaggregated_config_loads(tmp_path):
    spec = ClusterSpec(
        "disaggregated", PoolSpec(2, 2, kv_blocks=100), PoolSpec(4, 1, kv_blocks=900)
    )
    raw = spec.to_config("smollm2-135m", gpu=False, dtype="float32")
    raw["ray"] = {"num_cpus": 64}
    config = load_config(raw)
    assert config.prefill.instances == 2 and config.decode.kv_blocks == 900
    assert config.kv_transfer.backend == "gloo"


def test_plan_errors(capsys):
    assert main(["plan", "--devices", "8"]) == 2
    assert "--model" in capsys.readouterr().err
    assert main(["plan", "--model", "opt-13b", "--devices", "8", "--hardware", "tpu"]) == 2
    assert "a100, h100, h200" in capsys.readouterr().err


def test_hybrid_candidates_and_config():
    from pdserve.loadgen.metrics import SLO
    from pdserve.planner.search import SearchConfig, candidates

    phase = {("prefill", 1): 2.0, ("decode", 1): 3.0, ("colocated", 1): 1.0}
    cfg = SearchConfig(devices=2, slo=SLO(ttft_ms=500, tpot_ms=80), modes=("hybrid",))
    [c] = candidates(phase, cfg, [1])
    assert c.cluster.mode == "hybrid" and c.cluster.tpot_ms == 80 and c.estimate == 2.0
    assert c.cluster.describe() == "hybrid prefill 1x tp1 + decode 1x tp1"
    both = SearchConfig(devices=2, modes=("disaggregated", "hybrid", "colocated"))
    assert [c.cluster.mode for c in candidates(phase, both, [1])] == [
        "disaggregated",
        "hybrid",
        "colocated",
    ]
    raw = c.cluster.to_config("smollm2-135m", gpu=False, dtype="float32", slo={"tpot_ms": 80})
    config = load_config(raw)
    assert config.mode == "hybrid" and config.slo.tpot_ms == 80
