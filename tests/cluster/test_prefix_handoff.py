"""Prefix reuse across the handoff through real disaggregated clusters (Ray, the gRPC
router, gloo and gRPC KV transfer, tensor-parallel instances of 1 and 2 ranks on either
side): conversations of two turns, each second turn's prompt = the first prompt + its
output + new tokens, the second turns of some sharing a system prompt. Greedy outputs
equal the offline engine's with prefix caching off; each second turn moves the KV of
only the blocks its decode instance lacked (``kv_bytes`` against the block math, and the
``kv_cached_tokens`` it reports for the blocks it held); with
``prefix_caching: false`` on both pools every turn moves its whole prompt; afterwards
every instance passes ``check_integrity()`` with every block free.
tests/test_prefix_handoff.py covers the handoff's failures with shared blocks."""

from __future__ import annotations

import pytest

from pdserve.engine import LLM, SamplingParams
from tests.cluster.helpers import all_blocks_free, wait_until
from tests.cluster.test_disagg import check_pools, disagg_config, run_concurrently

BS = 16
SYSTEM = [3 + (11 * i) % 240 for i in range(36)]  # a system prompt: 2 full blocks + 4
FIRSTS = [  # first prompts: 2 alone, 2 after the shared system prompt
    [5 + (3 * i) % 200 for i in range(23)],
    [9 + (13 * i) % 230 for i in range(70)],
    SYSTEM + [7, 8, 9, 10, 11],
    SYSTEM + [200 - i for i in range(30)],
]
NEW = [40, 41, 42, 43, 44, 45, 46, 47, 48]
MAX_TOKENS = 12
SETUPS = [  # backend, prefill TP, decode TP, prefix caching on both pools: each backend
    # once, each side once at 2 ranks (kv_transfer/test_head_mapping covers every pairing)
    ("gloo", 1, 2, True),
    ("grpc", 2, 1, True),
    ("gloo", 1, 1, False),
]


@pytest.fixture(scope="module")
def expected(kv4_model):
    """Both turns' prompts, the offline engine's greedy outputs (prefix caching off) and
    the bytes one block of KV moves (K and V, every layer, every head)."""
    llm = LLM(kv4_model, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    firsts = [o.token_ids for o in llm.generate(FIRSTS, params)]
    seconds = [p + o + NEW for p, o in zip(FIRSTS, firsts, strict=True)]
    outs = [o.token_ids for o in llm.generate(seconds, params)]
    cache = llm.engine.runner.kv_cache  # [layers, 2, blocks, block size, heads, dim]
    block_bytes = cache[:, :, 0].numel() * cache.element_size()
    llm.close()
    return firsts, seconds, outs, block_bytes


def blocks(n: int) -> int:
    return -(-n // BS)


@pytest.mark.parametrize(
    "backend,prefill_tp,decode_tp,caching",
    SETUPS,
    ids=[f"{b}-P{p}D{d}-{'cached' if c else 'off'}" for b, p, d, c in SETUPS],
)
def test_second_turns_move_only_what_decode_lacks(
    kv4_model, expected, on_shared_ray, backend, prefill_tp, decode_tp, caching
):
    from pdserve.cluster import launch

    firsts, seconds, outs, block_bytes = expected
    config = disagg_config(kv4_model, backend, backend == "gloo", 1)
    config["prefill"].update(tensor_parallel=prefill_tp, prefix_caching=caching,
                             resources={"num_cpus": 0.5})  # fmt: skip
    config["decode"].update(tensor_parallel=decode_tp, prefix_caching=caching,
                            resources={"num_cpus": 0.5})  # fmt: skip
    with launch(config) as cluster:
        client = cluster.client()
        turn1 = run_concurrently(client, [(p, MAX_TOKENS) for p in FIRSTS])
        turn2 = run_concurrently(client, [(p, MAX_TOKENS) for p in seconds])
        for prompt, chunks, want in zip(FIRSTS, turn1, firsts, strict=True):
            assert [t for c in chunks for t in c.token_ids] == want
            # a first turn may share the system prompt with another one that was done;
            # the rest of its blocks moved
            t = chunks[-1].timings
            assert t.kv_cached_tokens % BS == 0 and t.kv_cached_tokens < len(prompt)
            assert t.kv_bytes == (blocks(len(prompt)) - t.kv_cached_tokens // BS) * block_bytes
        for first, prompt, chunks, want in zip(FIRSTS, seconds, turn2, outs, strict=True):
            assert [t for c in chunks for t in c.token_ids] == want
            # the decode instance holds the full blocks of the first turn's computed KV
            # (prompt + output but the last token), capped below the prompt's last token
            held = min((len(first) + MAX_TOKENS - 1) // BS, (len(prompt) - 1) // BS)
            held = held if caching else 0
            assert chunks[-1].timings.kv_bytes == (blocks(len(prompt)) - held) * block_bytes
            assert chunks[-1].timings.kv_cached_tokens == held * BS  # reported end to end
        assert wait_until(lambda: all_blocks_free(client.stats()), 10), client.stats()
        check_pools(cluster)
        client.close()
