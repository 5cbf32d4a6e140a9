"""The engine gives the same greedy tokens with the Triton backend as with torch."""

import pytest
from paged_cases import DEVICE

from pdserve.engine import LLM, SamplingParams

# Lengths that end inside, at and past 16-token blocks; with a 16-token step budget the
# long prompts are prefilled in chunks, in the same steps as the short ones decode.
PROMPTS = [[(7 * i + 3 * j) % 250 + 3 for j in range(n)] for i, n in enumerate([37, 5, 16, 23])]


def _generate(model_path, backend, steps):
    llm = LLM(
        model_path,
        dtype="float32",
        block_size=16,
        num_kv_blocks=64,
        max_batch_tokens=16,
        max_batch_size=8,
        attention_backend=backend,
        device=DEVICE,
    )
    attn = llm.engine.model.attn
    forward = attn.forward

    def spy(q, k, v, k_cache, v_cache, meta, scale, **layer):  # window, softcap
        if k_cache is llm.engine.runner.kv_caches[0][0]:
            p = meta.num_prefills
            chunked = meta.query_lens_host[:p] != meta.seq_lens_host[:p]
            steps.append((p, meta.num_decodes, chunked))
        return forward(q, k, v, k_cache, v_cache, meta, scale, **layer)

    attn.forward = spy
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    return [out.token_ids for out in llm.generate(PROMPTS, params)]


@pytest.mark.parametrize("shape", ["gqa2", "mqa"])
def test_same_greedy_tokens_as_torch(tiny_model, shape):
    path = tiny_model(shape)
    steps = []
    triton_tokens = _generate(path, "triton", steps)
    assert triton_tokens == _generate(path, "torch", [])
    assert any(p and d for p, d, _ in steps), "no mixed prefill + decode step"
    assert any(p and chunked for p, _, chunked in steps), "no prefill chunk after cached context"
    assert any(not p and d for p, d, _ in steps), "no decode-only step"
