"""Window-aware KV transfer (docs/kv_transfer.md, "Sliding windows"), through the
instances' own entry points in this process: a prefill and a decode instance of a tiny
Mistral whose every layer slides over 8 tokens, blocks of 4, a real transfer over gRPC
(layer-wise) and gloo (after the pass) with checksums.

For prompts of 4x the window, the decode instance reserves placeholders for the blocks
wholly before the window of the first decoded token (``KVDestination.outside_blocks``)
and holds only the rest, at most window / block_size + 1; only those move (``kv_bytes``),
the output is the offline engine's, no placeholder is registered in the decode
instance's prefix cache, and every block is free afterwards on both instances.
"""

from __future__ import annotations

import pytest
import torch

from decode_worker import DecodeWorker
from engine import LLM
from prefill_worker import PrefillWorker
from tests.kv_transfer.helpers import WORKER_KV
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


@pytest.fixture(scope="module", params=[("grpc", True), ("gloo", False)], ids=["grpc", "gloo"])
def workers(mistral, request):
    """A prefill and a decode instance (one torch thread each: restored after)."""
    backend, layerwise = request.param
    kv = {**WORKER_KV, "backend": backend, "layerwise": layerwise}
    threads = torch.get_num_threads()
    p = PrefillWorker("prefill-0", mistral[0], CONFIG, 1, kv)
    d = DecodeWorker("decode-0", mistral[0], CONFIG, 1, kv)
    yield p, d
    p.stop()
    d.stop()
    torch.set_num_threads(threads)


@pytest.mark.timeout(180)
def test_only_the_blocks_inside_the_window_move(workers, mistral):
    p, d = workers
    outs = mistral[1]
    for i, (prompt, want) in enumerate(zip(PROMPTS, outs, strict=True)):
        rid = f"w{i}-{d.transport.name}#0"
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
