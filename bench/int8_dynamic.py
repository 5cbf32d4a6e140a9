"""What int8 activations would buy and cost: FBGEMM's dynamic-quant linear (torch's
``quantize_dynamic``: int8 weights per channel, each activation row quantized to int8 on
the fly) on HF transformers' SmolLM2-135M, against the same model in float32.

    .venv/bin/python -m pdserve.bench.int8_dynamic [--threads 2]

Speed: prefill of 512 tokens (last logit only) and decode at batch 1 and 32 (128-token
contexts, 16 steps), best of 3, the two models taking turns. Accuracy, on the prompts of
tests/test_hf_parity.py: the largest logit error against float32 over every prompt
position, against the tolerance those tests hold the engine to (|d| <= 2e-3 + 1e-3 |x|),
and the greedy continuations (32 tokens) that stay equal. The engine keeps float32
products (docs/performance.md, "Which path each operation takes"): this bench is why.
"""

from __future__ import annotations

import argparse
import copy

import torch

from pdserve.bench.engine import alternating_best, hf_decode, hf_prefill
from pdserve.engine.checkpoint import resolve
from tests.engine_utils import hf_greedy

TEXTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
]


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    folder = resolve("smollm2-135m")
    fp32 = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    int8 = torch.ao.quantization.quantize_dynamic(
        copy.deepcopy(fp32), {torch.nn.Linear}, dtype=torch.qint8
    )
    print(f"torch {torch.__version__}, quantized engine {torch.backends.quantized.engine}")
    t32, t8 = alternating_best([hf_prefill(fp32, 512), hf_prefill(int8, 512)], 3)
    print(
        f"prefill 512: float32 {512 / t32:.0f} tok/s, int8 {512 / t8:.0f} tok/s ({t32 / t8:.2f}x)"
    )
    for batch in (1, 32):
        d32 = max(hf_decode(fp32, batch, 16) for _ in range(3))
        d8 = max(hf_decode(int8, batch, 16) for _ in range(3))
        print(
            f"decode batch {batch}: float32 {d32:.0f} tok/s, int8 {d8:.0f} tok/s ({d8 / d32:.2f}x)"
        )
    tokenizer = AutoTokenizer.from_pretrained(folder)
    worst, outside, total = 0.0, 0, 0
    equal = []
    for text in TEXTS:
        ids = tokenizer(text)["input_ids"]
        with torch.no_grad():
            a, b = fp32(torch.tensor([ids])).logits[0], int8(torch.tensor([ids])).logits[0]
        diff = (a - b).abs()
        worst = max(worst, diff.max().item())
        outside += int((diff > 2e-3 + 1e-3 * a.abs()).sum())
        total += diff.numel()
        equal.append(hf_greedy(fp32, ids, 32) == hf_greedy(int8, ids, 32))
    print(
        f"int8 logits: largest error {worst:.3f}; {outside} of {total} outside the parity "
        f"tolerance; greedy continuations equal: {sum(equal)} of {len(equal)}"
    )


if __name__ == "__main__":
    main()
