"""An MLA model (tiny DeepSeek-V3) gives the same greedy tokens with the Triton backend
(its ops, and ``kernels/paged_latent_decode.py`` for the absorbed decode) as with torch."""

import pytest
from paged_cases import DEVICE

from pdserve.engine import LLM, SamplingParams

pytest.importorskip("pdserve.kernels.paged_latent_decode")

# 16-token step budget: the 37-token prompt runs in chunks beside the others' decodes
PROMPTS = [[(7 * i + 3 * j) % 250 + 3 for j in range(n)] for i, n in enumerate([37, 5, 16, 23])]


def _generate(path: str, backend: str) -> list[list[int]]:
    llm = LLM(path, block_size=16, num_kv_blocks=64, max_batch_tokens=16, max_batch_size=8,
              attention_backend=backend, device=DEVICE)  # fmt: skip
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    return [out.token_ids for out in llm.generate(PROMPTS, params)]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("shape", ["v3", "v3_q_proj"])
def test_same_greedy_tokens_as_torch(tiny_mla_model, shape):
    path = tiny_mla_model(shape)
    assert _generate(path, "triton") == _generate(path, "torch")
