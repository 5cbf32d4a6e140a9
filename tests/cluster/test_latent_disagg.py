"""Latent and tied KV through real disaggregated clusters (Ray, the gRPC router, gloo and
gRPC KV transfer, prefill and decode instances of 1 and 2 tensor-parallel ranks): a tiny
DeepSeek-V3 (MLA: one latent, replicated on every rank) and a tiny GLA-2 (two latent
heads, one per rank at TP 2). Greedy outputs equal the offline engine's, and each request
moves exactly the bytes of kv_transfer/layout.py's rule (docs/kv_transfer.md, "Latent
caches"): every decode rank receives its own row of every block of every layer once, its
latent heads (all of MLA's) and the one RoPE key."""

from __future__ import annotations

import pytest
import ray

from engine import LLM, SamplingParams
from tests.cluster.helpers import all_blocks_free, wait_until
from tests.cluster.test_disagg import check_pools, disagg_config, run_concurrently

BS = 16
MAX_TOKENS = 20
PROMPTS = [
    [5 + (3 * i) % 200 for i in range(23)],
    [9 + (13 * i) % 230 for i in range(70)],
    [7, 8, 9],
    [3 + (11 * i) % 240 for i in range(150)],
]
SETUPS = [  # model, backend, prefill TP, decode TP, prefill chunk, decode KV blocks
    ("mla", "gloo", 1, 2, 7, 256),
    ("mla", "grpc", 2, 1, 1, 256),
    ("gla-2", "gloo", 2, 2, 256, 256),
    ("gla-2", "grpc", 1, 2, 7, 256),
    # 19 blocks: the prompts' 2 + 5 + 1 + 10 fit, the KV at their ends (prompt + 19
    # tokens: 3 + 6 + 2 + 11 blocks) does not, so decode preempts and recomputes
    ("mla", "gloo", 1, 1, 256, 19),
]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (folder, the offline engine's greedy outputs, bytes per token one decode
    rank receives, by decode TP)."""
    from tests.latent_reference import save_tiny_gla
    from tests.tiny_models import TINY_MLA_SHAPES, save_byte_tokenizer, save_tiny_deepseek

    made = {}
    for name, save in (
        ("mla", lambda f: save_tiny_deepseek(f, **TINY_MLA_SHAPES["v3"])),
        ("gla-2", lambda f: save_tiny_gla(f, 2)),
    ):
        folder = tmp_path_factory.mktemp(f"latent-{name}")
        save(folder)
        save_byte_tokenizer(folder)
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        with LLM(str(folder), enable_prefix_caching=False) as llm:
            outs = [o.token_ids for o in llm.generate(PROMPTS, params)]
            cfg = llm.engine.model.cfg
        m = cfg.mla
        per_rank = {}
        for tp in (1, 2):
            heads = m.latent_heads if m.replicated else m.latent_heads // tp
            per_rank[tp] = cfg.num_layers * (heads * m.kv_lora_rank + m.qk_rope_head_dim) * 4
        made[name] = (str(folder), outs, per_rank)
    return made


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "model,backend,prefill_tp,decode_tp,chunk,decode_blocks",
    SETUPS,
    ids=[f"{m}-{b}-P{p}D{d}-chunk{c}-blocks{n}" for m, b, p, d, c, n in SETUPS],
)
def test_latent_kv_hands_off_to_the_offline_greedy(
    models, model, backend, prefill_tp, decode_tp, chunk, decode_blocks
):
    from cluster import launch

    folder, outs, per_rank = models[model]
    config = disagg_config(folder, backend, backend == "gloo", 1)
    config["prefill"].update(tensor_parallel=prefill_tp, prefix_caching=False,
                             max_batch_tokens=chunk, resources={"num_cpus": 0.5})  # fmt: skip
    config["decode"].update(tensor_parallel=decode_tp, prefix_caching=False,
                            kv_blocks=decode_blocks, resources={"num_cpus": 0.5})  # fmt: skip
    with launch(config) as cluster:
        client = cluster.client()
        got = run_concurrently(client, [(p, MAX_TOKENS) for p in PROMPTS])
        for prompt, chunks, want in zip(PROMPTS, got, outs, strict=True):
            assert [t for c in chunks for t in c.token_ids] == want
            blocks = -(-len(prompt) // BS)
            # each decode rank receives its row of every block, whole blocks
            want_bytes = blocks * BS * per_rank[decode_tp] * decode_tp
            assert chunks[-1].timings.kv_bytes == want_bytes
        decode = ray.get(cluster.workers["decode-0"].stats.remote())
        assert (decode["preemptions_total"] > 0) == (decode_blocks < 256), decode
        assert wait_until(lambda: all_blocks_free(client.stats()), 10), client.stats()
        check_pools(cluster)
        client.close()
