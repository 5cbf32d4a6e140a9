"""``ScheduledBatch.shape()``: what each step computed, as the served-step profile logs it."""

from __future__ import annotations

from pdserve.engine import EngineConfig, LLMEngine, SamplingParams
from pdserve.engine.scheduler import StepShape


def test_chunks_then_decodes_then_mixed(tiny_model):
    engine = LLMEngine(tiny_model("gqa2"), EngineConfig(max_batch_tokens=4, num_kv_blocks=64))
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    engine.add_request("a", list(range(3, 13)), params)  # 10 prompt tokens: chunks 4, 4, 2
    shapes = []
    while engine.has_unfinished_requests():
        engine.step()
        shapes.append(engine.last_shape)
        if len(shapes) == 3:
            engine.add_request("b", list(range(5, 11)), params)  # joins beside a's decodes
    assert shapes[:3] == [
        StepShape(4, 16, 0, 0),
        StepShape(4, 64 - 16, 0, 0),
        StepShape(2, 100 - 64, 0, 0),
    ]
    # a decodes (its KV holds 10 then 11 tokens) while b's prompt runs in 3 + 3 tokens
    assert shapes[3] == StepShape(3, 9, 1, 11)
    assert shapes[4] == StepShape(3, 36 - 9, 1, 12)
    assert shapes[5] == StepShape(0, 0, 1, 7)  # a has finished; b decodes over 6 + 1
    engine.blocks.check_integrity()
