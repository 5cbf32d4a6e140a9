"""Prompt logprobs in the engine (``SamplingParams.prompt_logprobs``) against HF
transformers' log-softmax over the same prompt, on each ISA the CPU has: computed in the
prefill pass, chunk by chunk (chunks of 16 and 64 tokens, and the prompt whole), beside
requests that do not ask; after a preemption mid-prompt; never from the prefix cache;
and through the engine's handoff entry points (``Prefilled`` -> ``land``), where they
come with the decode side's first output."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.prefilled import Prefilled
from pdserve.engine.scheduler import ScheduledBatch

TOP = 4
PROMPTS = [
    torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    for n in (70, 33, 1)
]


@pytest.fixture(scope="module")
def hf(tiny_model):
    """The model's path, and HF's log-softmax per prompt ([len - 1, vocab])."""
    from transformers import AutoModelForCausalLM

    path = tiny_model("gqa2")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        rows = [torch.log_softmax(model(torch.tensor([p])).logits[0, :-1], -1) for p in PROMPTS]
    return path, rows


def check(prompt: list[int], want: torch.Tensor, got) -> None:
    assert got[0] is None and len(got) == len(prompt)
    for i, lp in enumerate(got[1:]):
        row, token = want[i], prompt[i + 1]
        assert lp.token_id == token
        assert abs(lp.logprob - row[token].item()) <= 1e-4, (i, lp.logprob, row[token])
        assert list(lp.top_ids) == row.topk(TOP).indices.tolist(), i
        torch.testing.assert_close(
            torch.tensor(lp.top_logprobs), row.topk(TOP).values, atol=1e-4, rtol=0
        )
        assert lp.rank == int((row > row[token]).sum()) + 1


@pytest.mark.parametrize("chunk", [16, 64, 256])
def test_prompt_logprobs_are_hfs_in_chunks(isa, hf, chunk):
    path, want = hf
    llm = LLM(path, max_batch_tokens=chunk, num_kv_blocks=64)
    asked = SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=TOP)
    plain = SamplingParams(max_tokens=3, temperature=0)
    outs = llm.generate([*PROMPTS, PROMPTS[0]], [asked, asked, asked, plain])
    for prompt, rows, out in zip(PROMPTS, want, outs, strict=False):
        check(prompt, rows, out.prompt_logprobs)
    assert outs[3].prompt_logprobs is None
    assert outs[3].token_ids == outs[0].token_ids  # asking changes no output
    # the prompt's blocks are cached now: asking again computes it again all the same
    again = llm.generate([PROMPTS[0]], asked)[0]
    check(PROMPTS[0], want[0], again.prompt_logprobs)
    assert again.num_cached_tokens == 0
    assert llm.generate([PROMPTS[0]], plain)[0].num_cached_tokens > 0
    llm.engine.check_integrity()


def test_a_preemption_mid_prompt_keeps_the_logprobs_computed(hf):
    """A prompt preempted part-way is recomputed from its start; the logprobs of the
    chunks before stay, and each prompt token has exactly one."""
    path, want = hf
    engine = LLMEngine(path, EngineConfig(max_batch_tokens=16, num_kv_blocks=64))
    engine.add_request("a", PROMPTS[0], SamplingParams(max_tokens=2, prompt_logprobs=TOP))
    engine.step()
    engine.step()  # 32 of its 70 tokens computed
    request = engine.requests["a"]
    assert len(request.prompt_logprobs) == 33
    engine.scheduler._preempt(request, ScheduledBatch())  # as a full cache would
    got = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            got = out.prompt_logprobs if out.prompt_logprobs is not None else got
    check(PROMPTS[0], want[0], got)
    engine.check_integrity()


def test_the_handoff_carries_them_to_the_first_output(hf):
    path, want = hf
    config = EngineConfig(max_batch_tokens=32, num_kv_blocks=64)
    prefill, decode = LLMEngine(path, config), LLMEngine(path, config)
    params = SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=TOP)
    prefill.add_request("a", PROMPTS[0], params, hand_off=True)
    left = None
    while left is None:
        left = next((o for o in prefill.step() if isinstance(o, Prefilled)), None)
    check(PROMPTS[0], want[0], left.prompt_logprobs)
    reservation = decode.reserve("a", PROMPTS[0], params)
    with pytest.raises(ValueError, match="wants 70 prompt entries, the handoff carried None"):
        decode.land("a", left.first_token)
    reservation = decode.reserve("a", PROMPTS[0], params)
    src, dst = prefill.kv_view().cache, decode.kv_view().cache
    for i, j in zip(left.block_ids, reservation.block_ids, strict=True):
        dst[:, :, j] = src[:, :, i]
    (first,) = decode.land("a", left.first_token, None, left.prompt_logprobs)
    check(PROMPTS[0], want[0], first.prompt_logprobs)
    later = [o for o in decode.step() if o.request_id == "a"]
    assert later and all(o.prompt_logprobs is None for o in later)
    prefill.release("a")
    for engine in (prefill, decode):
        while engine.has_unfinished_requests():
            engine.step()
        engine.check_integrity()
