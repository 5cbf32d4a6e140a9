"""Speculative decoding of sampled requests (engine/speculative.py, ``Sampler.verify``)
on the embedded model, whose guesses hold often enough to exercise both outcomes: the
output distribution is the plain engine's (a chi-square test), and a seeded request's
output is the plain one's, token for token. Once, on the CPU's default kernels
(tests/test_speculative.py runs the rest on each ISA)."""

from __future__ import annotations

import torch

from pdserve.engine import LLM, SamplingParams


def chi_square_p(a: list, b: list) -> float:
    """The p-value of Pearson's chi-square test that samples ``a`` and ``b`` (equal
    sizes) come from one distribution: categories seen fewer than 10 times in both
    together pooled into one."""
    counts: dict = {}
    for x in a:
        counts.setdefault(x, [0, 0])[0] += 1
    for x in b:
        counts.setdefault(x, [0, 0])[1] += 1
    table = [c for c in counts.values() if sum(c) >= 10]
    rest = [sum(c[i] for c in counts.values() if sum(c) < 10) for i in (0, 1)]
    if sum(rest):
        table.append(rest)
    t = torch.tensor(table, dtype=torch.float64)
    expected = t.sum(1, keepdim=True) * t.sum(0, keepdim=True) / t.sum()
    statistic = ((t - expected) ** 2 / expected).sum()
    dof = (len(table) - 1) * (2 - 1)
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), statistic / 2))


def test_sampling_with_guesses_has_the_plain_distribution():
    """The embedded model continuing a count it has seen (its guesses often hold),
    sampled: 100 seeded samples of a short continuation equal the plain engine's, seed
    for seed; 300 unseeded ones, the two engines' generators seeded apart, cannot be
    told from the plain engine's by a chi-square test at p = 0.01 (each row's draw
    decides its guess: rejection sampling of a one-token proposal). One request at a
    time, its prompt's blocks from the prefix cache."""
    text = " ".join(["one two three four five six seven eight nine ten"] * 4)
    samples, guessed = {}, {}
    for k, engine_seed in ((0, 1), (3, 2)):
        llm = LLM("smollm2-135m", speculative_tokens=k, num_kv_blocks=64, max_batch_size=1,
                  seed=engine_seed)  # fmt: skip
        prompt = llm.tokenizer.encode(text)[:-3]  # it ends "... seven": the rest follows
        runner, rows = llm.engine.runner, []
        verify = runner._verify
        runner._verify = lambda logits, spec, rows=rows, verify=verify: (
            rows.append(len(logits)) or verify(logits, spec)
        )
        seeded = [SamplingParams(max_tokens=3, temperature=0.6, seed=s) for s in range(100)]
        unseeded = [SamplingParams(max_tokens=3, temperature=0.6)] * 300
        outs = llm.generate([prompt] * 400, seeded + unseeded)
        samples[k] = [tuple(o.token_ids) for o in outs]
        guessed[k] = sum(rows)
        llm.engine.check_integrity()
    assert guessed[0] == 0 and guessed[3] > 400  # the speculative engine verified guesses
    assert samples[3][:100] == samples[0][:100]
    assert samples[3][100:] != samples[0][100:]  # independent draws
    assert chi_square_p(samples[0][100:], samples[3][100:]) > 0.01
