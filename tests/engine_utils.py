"""Helpers that drive the engine below the LLM API."""

from __future__ import annotations

import torch

from pdserve.engine import LLMEngine, SamplingParams
from pdserve.engine.request import Request


def prompt_logits(engine: LLMEngine, ids: list[int]) -> torch.Tensor:
    """Logits [len(ids), vocab] of every prompt position, through the paged cache."""
    request = Request("logits-probe", ids, SamplingParams(max_tokens=1))
    engine.blocks.allocate(request.request_id, len(ids))
    try:
        items, input_ids, positions, meta = engine.runner.prepare([(request, len(ids))])
        hidden = engine.model(input_ids, positions, engine.runner.kv_caches, meta)
        return engine.model.logits(hidden)
    finally:
        engine.blocks.free(request.request_id)


def stepwise_logits(engine: LLMEngine, ids: list[int], prompt_len: int) -> torch.Tensor:
    """Logits [len(ids) - prompt_len + 1, vocab] of positions prompt_len - 1 onwards: the
    first prompt_len tokens in one pass, then the rest one decode step each."""
    request = Request("stepwise", ids, SamplingParams(max_tokens=1))
    engine.blocks.allocate(request.request_id, len(ids))
    rows = []
    try:
        for n in [prompt_len] + [1] * (len(ids) - prompt_len):
            _, input_ids, positions, meta = engine.runner.prepare([(request, n)])
            hidden = engine.model(input_ids, positions, engine.runner.kv_caches, meta)
            rows.append(engine.model.logits(hidden[-1:]))
            request.num_computed_tokens += n
    finally:
        engine.blocks.free(request.request_id)
    return torch.cat(rows)


def run_staggered(engine: LLMEngine, arrivals: dict[int, list[tuple[str, list[int]]]], params):
    """Add requests at given step numbers; returns {request_id: output token ids}."""
    done: dict[str, list[int]] = {}
    step = 0
    while arrivals or engine.has_unfinished_requests():
        for rid, ids in arrivals.pop(step, []):
            engine.add_request(rid, ids, params)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
        step += 1
    return done


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """Greedy continuation with HF transformers, one token at a time with its KV cache,
    ignoring EOS (the oracle for ignore_eos=True runs)."""
    out, past = [], None
    x = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            res = model(input_ids=x, cache=past, use_cache=True)
            past = res.past_key_values
            token = int(res.logits[0, -1].argmax())
            out.append(token)
            x = torch.tensor([[token]])
    return out


def gguf_blocks(w: torch.Tensor, kind: str) -> torch.Tensor:
    """w through the gguf package's own quantizer (``kind``: Q4_1, Q8_0, ...) and back:
    the float32 values a GGUF of w loads as."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    qtype = GGMLQuantizationType[kind]
    back = dequantize(quantize(w.float().numpy(), qtype), qtype)
    return torch.from_numpy(np.array(back, dtype=np.float32)).reshape(w.shape)
