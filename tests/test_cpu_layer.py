"""The C decode layers (``engine/cpu_layer.py``) against the torch layers, on a real
engine's paged cache: same hidden states, same KV written, same tokens."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.cpu_gemm import F32, Q4, PanelWeight, cpu_gemm
from pdserve.engine.request import Request
from tests.engine_utils import gguf_blocks

# every test on each ISA the CPU has (tests/conftest.py isa)
pytestmark = pytest.mark.usefixtures("isa")


def _decode_batch(engine, lengths, seed=0):
    """Requests whose prompts are cached, each with one new token to decode."""
    g = torch.Generator().manual_seed(seed)
    items = []
    for i, n in enumerate(lengths):
        ids = torch.randint(3, 200, (n + 1,), generator=g).tolist()
        request = Request(f"r{i}", ids, SamplingParams(max_tokens=4))
        engine.blocks.allocate(request.request_id, n + 1)
        request.num_computed_tokens = n
        items.append((request, 1))
    return items


@pytest.mark.parametrize("name", ["gqa3", "mqa", "mha"])
@pytest.mark.parametrize("lengths", [[5], [1, 16, 17, 40, 3]])
def test_decode_step_matches_the_torch_layers(tiny_model, name, lengths):
    llm = LLM(tiny_model(name), max_batch_tokens=64, num_kv_blocks=64)
    engine, model = llm.engine, llm.engine.model
    items = _decode_batch(engine, lengths)
    caches = engine.runner.kv_cache
    caches.normal_()  # the earlier tokens' KV: any values, the same for both paths
    before = caches.clone()
    _, input_ids, positions, meta = engine.runner.prepare(items)
    assert model.cpu_decode.begin(positions, engine.runner.kv_caches, meta) is not None
    fused = model(input_ids, positions, engine.runner.kv_caches, meta)
    fused_caches = caches.clone()

    caches.copy_(before)
    cpu_decode, model.cpu_decode = model.cpu_decode, None
    try:
        _, input_ids, positions, meta = engine.runner.prepare(items)
        plain = model(input_ids, positions, engine.runner.kv_caches, meta)
    finally:
        model.cpu_decode = cpu_decode
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused_caches, caches, rtol=1e-5, atol=1e-5)
    engine.blocks.check_integrity()


def test_gguf_block_weights_decode_as_their_floats(tiny_model):
    """Projections whose floats are Q4_1 blocks run from the blocks, and the step's
    hidden states are those of the float32 panels, bit for bit."""
    llm = LLM(tiny_model("gqa3"), max_batch_tokens=64, num_kv_blocks=64)
    engine, model = llm.engine, llm.engine.model
    names = ("qkv", "o", "gate_up", "down")
    for layer in model.layers:
        for name in names:  # in place: the panel twins hold these very tensors
            getattr(layer, name).copy_(gguf_blocks(getattr(layer, name), "Q4_1"))
    items = _decode_batch(engine, [1, 16, 17, 40, 3])
    caches = engine.runner.kv_cache
    caches.normal_()
    before = caches.clone()

    def step():
        model.cpu_decode.layers = []  # the C layers point at the panels anew
        _, input_ids, positions, meta = engine.runner.prepare(items)
        assert model.cpu_decode.begin(positions, engine.runner.kv_caches, meta) is not None
        return model(input_ids, positions, engine.runner.kv_caches, meta)

    blocks = step()
    assert {layer.panels[n].format for layer in model.layers for n in names} == {Q4}
    caches.copy_(before)
    for layer in model.layers:
        layer.panels = {n: PanelWeight(cpu_gemm(), getattr(layer, n), formats=()) for n in names}
    floats = step()
    assert {layer.panels[n].format for layer in model.layers for n in names} == {F32}
    assert torch.equal(blocks, floats)
    engine.blocks.check_integrity()


def test_only_small_decode_only_batches_take_the_c_path(tiny_model):
    llm = LLM(tiny_model("gqa2"), max_batch_tokens=64, num_kv_blocks=64)
    engine, model = llm.engine, llm.engine.model
    decodes = _decode_batch(engine, [4, 9])
    _, _, positions, meta = engine.runner.prepare(decodes)
    assert model.cpu_decode.begin(positions, engine.runner.kv_caches, meta) is not None
    model.attn.use_kernel = False
    assert model.cpu_decode.begin(positions, engine.runner.kv_caches, meta) is None
    model.attn.use_kernel = True

    prefill = Request("p", list(range(3, 10)), SamplingParams(max_tokens=2))
    engine.blocks.allocate("p", 7)
    _, _, positions, meta = engine.runner.prepare([*decodes, (prefill, 7)])
    assert model.cpu_decode.begin(positions, engine.runner.kv_caches, meta) is None


def test_greedy_output_is_the_same_either_way(tiny_model):
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompts = [list(range(3, 3 + n)) for n in (2, 11, 30)]
    llm = LLM(tiny_model("gqa3"), max_batch_tokens=64, num_kv_blocks=64)
    fused = [o.token_ids for o in llm.generate(prompts, params)]
    llm.engine.model.cpu_decode = None
    assert [o.token_ids for o in llm.generate(prompts, params)] == fused
