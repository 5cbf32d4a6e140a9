"""Window-aware KV transfer (docs/kv_transfer.md, "Sliding windows"), through the
instances' own entry points in this process: a prefill and a decode instance of a tiny
Mistral whose every layer slides over 8 tokens, blocks of 4, a real transfer over gRPC
(layer-wise) and gloo (after the pass) with checksums.

For prompts of 4x the window, the decode instance reserves placeholders for the blocks
wholly before the window of the first decoded token (``KVDestination.outside_blocks``)
and holds only the rest, at most window / block_size + 1; only those move (``kv_bytes``),
the output is the offline engine's, no placeholder is registered in the decode
instance's prefix cache, and every block is free afterwards on both instances.

A tiny Gemma 3 whose layers alternate sliding (window 8) and global has no
``cache_window``: every block is reserved (the global layers read them all), but each
sliding layer skips the blocks wholly before its window (``KVDestination.layer_skip``);
the bytes moved are the per-layer sum (``KVLayout.transfer_bytes``), the skipped blocks
of the sliding layers are filled with NaN on the decode instance before the transfer
(stale data no attention path may read) and the output is still the offline engine's;
no block some layer lacks is registered in the decode instance's prefix cache.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.decode_worker import Receiving
from pdserve.engine import LLM
from pdserve.instance.worker import EngineWorker
from tests.kv_transfer.helpers import WORKER_KV
from tests.roles import part, worker
from tests.test_prefix_handoff import (
    PARAMS,  # what ``reserve`` asks for: 20 greedy tokens
    assert_all_free,
    block_bytes,
    reserve,
    updates_until_final,
)

WINDOW, BS = 8, 4
# chunks of 7: the prefill instance releases blocks between its chunks too
CONFIG = {"num_kv_blocks": 64, "max_batch_tokens": 7, "block_size": BS}
PROMPTS = [  # 4x the window: 8 blocks, 2 in the window; 4x + 2: 9 blocks, 3 in it
    tuple(3 + (7 * i) % 200 for i in range(4 * WINDOW)),
    tuple(9 + (13 * i) % 230 for i in range(4 * WINDOW + 2)),
    (5, 6, 7),  # inside the window: everything moves
]


@pytest.fixture(scope="module")
def mistral(tiny_family_model):
    """The tiny Mistral and the offline engine's greedy outputs of ``PROMPTS``."""
    path = tiny_family_model("mistral_w8")
    with LLM(path, enable_prefix_caching=False, **CONFIG) as llm:
        assert llm.engine.model.cfg.cache_window == WINDOW
        outs = [o.token_ids for o in llm.generate([list(p) for p in PROMPTS], PARAMS)]
    return path, outs


@pytest.fixture(scope="module")
def gemma(tiny_family_model):
    """The tiny Gemma 3 (sliding, global, sliding, global), each layer's window and the
    offline engine's greedy outputs of ``PROMPTS``."""
    path = tiny_family_model("gemma3_w8")
    with LLM(path, enable_prefix_caching=False, **CONFIG) as llm:
        cfg = llm.engine.model.cfg
        windows = [cfg.window(layer) for layer in range(cfg.num_layers)]
        assert cfg.cache_window is None and windows == [WINDOW, None] * 2
        outs = [o.token_ids for o in llm.generate([list(p) for p in PROMPTS], PARAMS)]
    return path, windows, outs


BACKENDS = [("grpc", True), ("gloo", False)]


def pair(path, backend: str, layerwise: bool):
    """A prefill and a decode instance (one torch thread each: restored after)."""
    kv = {**WORKER_KV, "backend": backend, "layerwise": layerwise}
    threads = torch.get_num_threads()
    p = worker("prefill", "prefill-0", path, CONFIG, 1, kv)
    d = worker("decode", "decode-0", path, CONFIG, 1, kv)
    yield p, d
    p.stop()
    d.stop()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=BACKENDS, ids=["grpc", "gloo"])
def workers(mistral, request):
    yield from pair(mistral[0], *request.param)


@pytest.fixture(scope="module", params=BACKENDS, ids=["grpc", "gloo"])
def gemma_workers(gemma, request):
    yield from pair(gemma[0], *request.param)


def poison(d: EngineWorker, dst) -> None:
    """NaN into each layer's skipped blocks of the reservation: what the transfer leaves
    there is stale (another request's KV, or anything); none of it may be read."""
    cache = d.engine.runner.kv_cache  # [layers, 2 (K, V), blocks, block_size, heads, dim]
    for layer in range(part(d, Receiving).layout.num_layers):
        cache[layer, :, list(dst.block_ids[: dst.skip(layer)])] = float("nan")


@pytest.mark.timeout(180)
def test_only_the_blocks_inside_the_window_move(workers, mistral):
    p, d = workers
    outs = mistral[1]
    for i, (prompt, want) in enumerate(zip(PROMPTS, outs, strict=True)):
        rid = f"w{i}-{part(d, Receiving).transport.name}#0"
        a, dst = reserve(d, rid, prompt)
        n = len(prompt)
        blocks = -(-n // BS)
        outside = max(0, n - WINDOW + 1) // BS  # the next token at n reads n - 7 .. n
        assert (dst.outside_blocks, dst.cached_blocks) == (outside, 0)
        assert len(dst.block_ids) == blocks - outside <= WINDOW // BS + 1
        # the decode instance holds the window's blocks only
        assert d.on_loop(lambda r=rid: d.engine.blocks.num_held(r)) == len(dst.block_ids)
        p.prefill(a)
        got = updates_until_final(d, rid)
        assert got[-1].error is None, got[-1].error
        assert [t for u in got for t in u.token_ids] == want
        assert got[0].info["kv_bytes"] == len(dst.block_ids) * block_bytes(d)
        done = updates_until_final(p, rid)
        assert done[-1].handed_off and done[-1].info["kv_bytes"] == got[0].info["kv_bytes"]
        # the placeholders' blocks hold no KV of the prompt: nothing is found from its start
        assert d.on_loop(lambda q=prompt: d.engine.blocks.match([*q, 1])) == []
    assert dst.outside_blocks == 0  # the short prompt moved whole
    assert_all_free(p, d)


@pytest.mark.timeout(180)
def test_a_sliding_layer_moves_only_its_window(gemma_workers, gemma):
    p, d = gemma_workers
    _, windows, outs = gemma
    for i, (prompt, want) in enumerate(zip(PROMPTS, outs, strict=True)):
        rid = f"g{i}-{part(d, Receiving).transport.name}#0"
        a, dst = reserve(d, rid, prompt)
        n = len(prompt)
        blocks = -(-n // BS)
        # a sliding layer's next token at n reads n - 7 .. n; a global layer reads all
        skip = [0 if w is None else max(0, n - w + 1) // BS for w in windows]
        assert (dst.outside_blocks, dst.cached_blocks, len(dst.block_ids)) == (0, 0, blocks)
        assert dst.layer_skip == (tuple(skip) if any(skip) else ())
        d.on_loop(poison, d, dst)
        p.prefill(a)
        got = updates_until_final(d, rid)
        assert got[-1].error is None, got[-1].error
        assert [t for u in got for t in u.token_ids] == want
        layout = part(d, Receiving).layout
        per_layer_block = 2 * layout.block_bytes(layout.num_kv_heads)  # K and V
        moved = sum(blocks - s for s in skip) * per_layer_block
        assert got[0].info["kv_bytes"] == moved == layout.transfer_bytes(blocks, 1, skip)
        done = updates_until_final(p, rid)
        assert done[-1].handed_off and done[-1].info["kv_bytes"] == moved
        # block 0 lacks the sliding layers' KV: nothing is found from the prompt's start
        assert d.on_loop(lambda q=prompt: d.engine.blocks.match([*q, 1])) == []
    assert dst.layer_skip == ()  # the short prompt moved whole
    assert_all_free(p, d)
