"""The block manager under a sliding window: blocks wholly before the window of a
request's next token are released after each step (their table entries left as
placeholders), the books stay right, and the engine's output is that of HF's Mistral
(Llama with a sliding window) with the released blocks poisoned."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.attention.backend import AttentionBackend
from pdserve.engine.block_manager import CACHED, EMPTY, PLACEHOLDER, BlockManager
from tests.engine_utils import hf_greedy


def test_release_drops_the_blocks_wholly_before_the_window():
    bm = BlockManager(num_blocks=16, block_size=4, window=10)
    bm.allocate("a", 20)  # blocks of positions 0-3, 4-7, ..., 16-19
    table = list(bm.block_table("a"))
    # the next token at position 20 reads 11 .. 20: blocks 0 and 1 (positions 0-7) go
    assert bm.release_outside("a", 20) == 2
    assert bm.release_outside("a", 20) == 0
    assert bm.block_table("a") == table  # placeholders keep the table's indexing
    assert bm.num_held("a") == 3 and bm.num_free_blocks == 13
    assert [bm.state[b] for b in table[:2]] == [EMPTY, EMPTY]
    bm.check_integrity()
    bm.allocate("a", 21)
    assert bm.release_outside("a", 21) == 1  # reads 11 + 1 .. 21: block 2 (8-11) goes
    assert bm.release_outside("a", 23) == 0  # reads 14 .. 23: block 3 (12-15) stays
    assert bm.num_held("a") == 3
    bm.check_integrity()
    bm.free("a")
    assert bm.num_free_blocks == 16 and not bm.released
    bm.check_integrity()


def test_window_one_may_release_every_computed_block():
    bm = BlockManager(num_blocks=4, block_size=4, window=1)
    bm.allocate("a", 8)
    assert bm.release_outside("a", 8) == 2 and bm.num_held("a") == 0
    bm.check_integrity()
    bm.allocate("a", 9)
    assert bm.num_held("a") == 1
    bm.check_integrity()


def test_no_window_releases_nothing():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate("a", 30)
    assert bm.release_outside("a", 30) == 0 and bm.num_held("a") == 8


def test_released_placeholders_are_never_registered():
    """A prefilled request released before its commit (its transfer sent the window
    only): the placeholders' blocks hold no KV of its prefix, so none is registered and
    the prefix cache finds nothing from its first block."""
    bm = BlockManager(num_blocks=16, block_size=4, enable_caching=True, window=6)
    tokens = list(range(3, 23))
    bm.allocate("a", 20)
    assert bm.release_outside("a", 20) == 3  # reads 15 .. 20: blocks 0-2 (0-11) go
    bm.commit("a", tokens, 20)
    held = bm.block_table("a")[3:]
    assert sorted(bm.hash_of) == sorted(held[:2])  # the full blocks still held
    assert bm.match(tokens + [1]) == []
    bm.check_integrity()
    bm.free("a")
    bm.check_integrity()


def test_a_reservation_starts_with_placeholders_before_the_window():
    """A request whose KV arrives from elsewhere (a decode reservation) holds only the
    blocks inside the window of its next token, the others placeholders from the start;
    of a cached prefix only the blocks past them are taken, and no placeholder is ever
    registered."""
    bm = BlockManager(num_blocks=16, block_size=4, enable_caching=True, window=6)
    tokens = list(range(3, 30))
    bm.allocate("a", 24)
    bm.commit("a", tokens, 24)
    bm.free("a")  # 6 full blocks cached
    prefix = bm.match(tokens[:26])
    assert len(prefix) == 6
    outside = bm.window_start(26)  # the next token at 26 reads 21 .. 26: block 5 on
    assert outside == 5
    assert bm.num_new_blocks("b", 26, prefix, outside) == 2  # prefix[5] revived + 1 new
    new = bm.allocate("b", 26, prefix, outside)
    table = bm.block_table("b")
    assert len(new) == 1 and table == [PLACEHOLDER] * 5 + [prefix[5], *new]
    assert bm.num_held("b") == 2 and bm.num_free_blocks == 14
    assert [bm.state[b] for b in prefix[:5]] == [CACHED] * 5  # never taken
    bm.check_integrity()
    bm.commit("b", tokens, 26)
    assert bm.release_outside("b", 26) == 0
    bm.check_integrity()
    bm.free("b")
    assert bm.num_free_blocks == 16 and bm.num_cached_blocks == 6
    bm.check_integrity()
    # without a prefix: only the window's blocks are new, none before it is registered
    others = list(range(100, 120))
    new = bm.allocate("c", 20, placeholders=bm.window_start(20))  # reads 15 .. 20
    assert len(new) == 2 and bm.num_held("c") == 2
    bm.commit("c", others, 20)
    assert bm.match(others) == [] and bm.num_cached_blocks == 8  # blocks 3, 4 (12-19)
    bm.free("c")
    bm.check_integrity()


def test_placeholders_are_refused_where_they_mean_nothing():
    with pytest.raises(ValueError, match="placeholders=1.*window=None"):
        BlockManager(num_blocks=8, block_size=4).allocate("a", 8, placeholders=1)
    bm = BlockManager(num_blocks=8, block_size=4, window=4)
    with pytest.raises(ValueError, match="at most 2 placeholders"):
        bm.allocate("a", 8, placeholders=3)
    bm.allocate("a", 8)
    with pytest.raises(ValueError, match="empty table"):
        bm.allocate("a", 12, placeholders=1)
    assert bm.num_held("a") == 2
    bm.check_integrity()


@pytest.mark.parametrize("window", [0, -1, 2.0])
def test_bad_window_is_refused(window):
    with pytest.raises(ValueError, match="window"):
        BlockManager(num_blocks=8, block_size=4, window=window)


def test_integrity_catches_released_entries_without_a_window():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate("a", 8)
    bm.released["a"] = 1
    with pytest.raises(AssertionError, match="released"):
        bm.check_integrity()


@pytest.mark.parametrize("caching", [False, True])
def test_churn_under_a_window_keeps_the_books_right(caching):
    """Requests grow, commit, release and free at random; shared cached prefixes are
    taken, released and taken again; some requests start as reservations (placeholders
    before the window, as a decode instance reserves)."""
    rng = random.Random(0)
    bs, window = 4, 9
    bm = BlockManager(num_blocks=40, block_size=bs, enable_caching=caching, window=window)
    tokens = {f"r{i}": [rng.randrange(3) for _ in range(60)] for i in range(6)}
    done: dict[str, int] = {}
    for _ in range(400):
        rid = rng.choice(list(tokens))
        if rid in done and rng.random() < 0.1:
            bm.free(rid)
            del done[rid]
        elif rid not in done:
            prefix = bm.match(tokens[rid][:30])
            n = len(prefix) * bs + rng.randint(1, 12)
            outside = bm.window_start(n) if rng.random() < 0.3 else 0
            if bm.can_allocate(rid, n, prefix, outside):
                free, need = bm.num_free_blocks, bm.num_new_blocks(rid, n, prefix, outside)
                bm.allocate(rid, n, prefix, outside)
                assert free - bm.num_free_blocks == need
                done[rid] = n
        else:
            n = min(60, done[rid] + rng.randint(1, 8))
            if bm.can_allocate(rid, n):
                bm.allocate(rid, n)
                done[rid] = n
        if rid in done:
            bm.commit(rid, tokens[rid], done[rid])
            bm.release_outside(rid, done[rid])
            lo = max(0, done[rid] - window + 1)  # blocks from lo's on are held
            assert bm.num_held(rid) == -(-done[rid] // bs) - lo // bs
        bm.check_integrity()


class WindowedAttention(AttentionBackend):
    """The model's backend with every layer's attention limited to a sliding window."""

    def __init__(self, inner: AttentionBackend, window: int):
        self.inner, self.window, self.name = inner, window, inner.name
        self.use_kernel = inner.use_kernel  # the C decode layers run beside C kernels only

    def forward(self, q, k, v, k_cache, v_cache, meta, scale, window=None, softcap=None):
        return self.inner.forward(q, k, v, k_cache, v_cache, meta, scale, window=self.window)


def _hf_mistral(path: str, window: int):
    """HF's Mistral (Llama with a sliding window) holding the Llama checkpoint's weights."""
    from transformers import AutoConfig, AutoModelForCausalLM, MistralConfig, MistralForCausalLM

    llama = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    cfg = AutoConfig.from_pretrained(path).to_dict()
    keep = MistralConfig().to_dict().keys()
    mistral_cfg = MistralConfig(**{k: v for k, v in cfg.items() if k in keep})
    mistral_cfg.sliding_window = window
    model = MistralForCausalLM(mistral_cfg).eval()
    model.load_state_dict(llama.state_dict())
    return model


@pytest.mark.timeout(600)
@pytest.mark.parametrize("chunk, c_layers", [(7, False), (512, False), (512, True)])
def test_engine_under_a_window_matches_hf_mistral_with_released_blocks_poisoned(
    tiny_model, chunk, c_layers
):
    """Prompts longer than the window, chunked or whole, decoded far past it (by the
    per-op layers or the C decode layers, engine/cpu_layer.py): every request holds at
    most ceil(W / block_size) + 1 blocks between steps, every block nobody holds is NaN
    after each step, and the greedy tokens are HF's."""
    path, window, bs = tiny_model("gqa2"), 10, 4
    llm = LLM(path, block_size=bs, num_kv_blocks=40, max_batch_tokens=chunk,
              enable_prefix_caching=False)  # fmt: skip
    engine = llm.engine
    engine.model.attn = WindowedAttention(engine.model.attn, window)
    for layer in engine.model.layers:
        layer.window = window  # what the C decode layers read
    if not c_layers:
        engine.model.cpu_decode = None
    elif engine.model.cpu_decode is None:
        pytest.skip("no C compiler: no C decode layers")
    engine.blocks.window = window
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (23, 41, 4)]
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, params)
    outputs: dict[str, list[int]] = {}
    released = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = list(out.token_ids)
        engine.blocks.check_integrity()
        released = max(released, sum(engine.blocks.released.values()))
        for request in engine.scheduler.running:
            assert engine.blocks.num_held(request.request_id) <= -(-window // bs) + 1
        empty = [b for b in range(engine.blocks.num_blocks) if engine.blocks.state[b] == EMPTY]
        engine.runner.kv_cache[:, :, empty] = float("nan")
    assert released >= 3 * (30 // bs)  # each request drops about one block per bs tokens
    hf = _hf_mistral(path, window)
    for i, ids in enumerate(prompts):
        assert outputs[str(i)] == hf_greedy(hf, ids, 30), i
