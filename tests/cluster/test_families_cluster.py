"""Every family of engine/families.py beside Llama through a real cluster (Ray, the gRPC
router, the real engine on the tiny checkpoints of tests/family_models.py with a byte
tokenizer): greedy outputs equal the offline engine's, and a disaggregated request moves
the KV bytes of the blocks it sends (docs/kv_transfer.md, "Sliding windows"). MLA runs
through tests/cluster/test_latent_disagg.py, Llama through tests/cluster/test_disagg.py.

Every family on every path, one cluster per row: co-located, disaggregated over gloo
with a prefill pool of TP 2, and over gRPC into a decode pool of TP 2 (Gemma 2 the other
way round), each family at chunk sizes 1, 7 and whole across its three rows:

| family | co-located (TP, chunk) | gloo (prefill TP, decode TP, chunk) | gRPC (same) |
| --- | --- | --- | --- |
| Qwen2 | 1, whole | 2, 1, 7 | 1, 2, 1 |
| Qwen3 | 1, 7 | 2, 1, whole | 1, 2, 1 |
| Gemma 2 (window 8, alternating with global layers) | 1, 1 | 1, 2, whole | 2, 1, 7 |
| Mistral (window 8, every layer) | 1, 1 | 2, 1, whole | 1, 2, 7 |
| Gemma 3 (window 8, alternating with global layers) | 1, 7 | 2, 1, 1 | 1, 2, whole |
| Phi-3 | 1, whole | 2, 1, 7 | 1, 2, 1 |

The windowed models (``*_w8``) get prompts of up to 5x their window. Blocks are 4 tokens,
so that a window of 8 leaves most of a long prompt's blocks outside it: a sliding layer
moves only the blocks inside the window of the first decoded token (Mistral: every
layer; Gemma 2 and 3: every other layer, the global ones moving every block), so the
bytes moved are the per-layer sum.
"""

from __future__ import annotations

import pytest

from pdserve.engine import LLM, SamplingParams
from tests.cluster.helpers import all_blocks_free, wait_until
from tests.cluster.test_disagg import check_pools, disagg_config, run_concurrently

BS = 4
MAX_TOKENS = 12
PROMPTS = [
    [5 + (3 * i) % 200 for i in range(23)],
    [7, 8, 9],
    [3 + (11 * i) % 240 for i in range(40)],
    [9 + (13 * i) % 230 for i in range(17)],
]
WHOLE = 64  # a chunk holding every prompt whole
SETUPS = [  # model, mode, backend, prefill TP, decode TP (co-located: its TP), chunk
    ("qwen2", "colocated", None, 1, 1, WHOLE),
    ("qwen2", "disaggregated", "gloo", 2, 1, 7),
    ("qwen2", "disaggregated", "grpc", 1, 2, 1),
    ("qwen3", "colocated", None, 1, 1, 7),
    ("qwen3", "disaggregated", "gloo", 2, 1, WHOLE),
    ("qwen3", "disaggregated", "grpc", 1, 2, 1),
    ("gemma2_w8", "colocated", None, 1, 1, 1),
    ("gemma2_w8", "disaggregated", "gloo", 1, 2, WHOLE),
    ("gemma2_w8", "disaggregated", "grpc", 2, 1, 7),
    ("mistral_w8", "colocated", None, 1, 1, 1),
    ("mistral_w8", "disaggregated", "gloo", 2, 1, WHOLE),
    ("mistral_w8", "disaggregated", "grpc", 1, 2, 7),
    ("gemma3_w8", "colocated", None, 1, 1, 7),
    ("gemma3_w8", "disaggregated", "gloo", 2, 1, 1),
    ("gemma3_w8", "disaggregated", "grpc", 1, 2, WHOLE),
    ("phi3", "colocated", None, 1, 1, WHOLE),
    ("phi3", "disaggregated", "gloo", 2, 1, 7),
    ("phi3", "disaggregated", "grpc", 1, 2, 1),
]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A factory: name -> (folder with a byte tokenizer, the offline engine's greedy
    outputs of ``PROMPTS``, KV bytes of one token of one layer (all KV heads), each
    layer's window (None: a global layer))."""
    from tests.family_models import save_tiny_family
    from tests.tiny_models import save_byte_tokenizer

    made = {}

    def get(name: str):
        if name not in made:
            folder = tmp_path_factory.mktemp(f"family-{name}")
            save_tiny_family(folder, name)
            save_byte_tokenizer(folder)
            params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
            with LLM(str(folder), enable_prefix_caching=False, block_size=BS) as llm:
                outs = [o.token_ids for o in llm.generate(PROMPTS, params)]
                cfg = llm.engine.model.cfg
            per_token = 2 * cfg.num_kv_heads * cfg.head_dim * 4  # K and V, fp32
            windows = [cfg.window(layer) for layer in range(cfg.num_layers)]
            made[name] = (str(folder), outs, per_token, windows)
        return made[name]

    return get


def sent_blocks(prompt_len: int, window: int | None) -> int:
    """Blocks a prompt's transfer moves for one layer: all of them, or for a sliding
    layer those inside its window at the first decoded token (position ``prompt_len``)."""
    first = 0 if window is None else max(0, prompt_len - window + 1) // BS
    return -(-prompt_len // BS) - first


def colocated_config(model: str, tp: int, chunk: int) -> dict:
    return {
        "model": model,
        "mode": "colocated",
        "router": {"host": "127.0.0.1", "port": 0, "http_port": 0, "max_queue": 16},
        "colocated": {"instances": 1, "tensor_parallel": tp, "max_batch_tokens": chunk,
                      "kv_blocks": 256, "block_size": BS, "prefix_caching": False,
                      "resources": {"num_cpus": 0.5}},
    }  # fmt: skip


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "model,mode,backend,prefill_tp,decode_tp,chunk",
    SETUPS,
    ids=[f"{m}-{b or 'colocated'}-P{p}D{d}-chunk{c}" for m, _, b, p, d, c in SETUPS],
)
def test_family_serves_the_offline_greedy(
    models, on_shared_ray, model, mode, backend, prefill_tp, decode_tp, chunk
):
    from pdserve.cluster import launch

    folder, outs, per_token, windows = models(model)
    if mode == "colocated":
        config = colocated_config(folder, decode_tp, chunk)
    else:
        config = disagg_config(folder, backend, backend == "gloo", 1)
        config["prefill"].update(tensor_parallel=prefill_tp, prefix_caching=False,
                                 max_batch_tokens=chunk, block_size=BS,
                                 resources={"num_cpus": 0.5})  # fmt: skip
        config["decode"].update(tensor_parallel=decode_tp, prefix_caching=False,
                                block_size=BS, resources={"num_cpus": 0.5})  # fmt: skip
    with launch(config) as cluster:
        client = cluster.client()
        got = run_concurrently(client, [(p, MAX_TOKENS) for p in PROMPTS])
        for prompt, chunks, want in zip(PROMPTS, got, outs, strict=True):
            assert [t for c in chunks for t in c.token_ids] == want, prompt
            if mode == "disaggregated":
                blocks = sum(sent_blocks(len(prompt), w) for w in windows)  # layer blocks
                assert chunks[-1].timings.kv_bytes == blocks * BS * per_token, prompt
        assert wait_until(lambda: all_blocks_free(client.stats()), 10), client.stats()
        check_pools(cluster)
        client.close()
