"""Workloads from the real datasets of the installed packages, with the embedded
SmolLM2 tokenizer: determinism per seed, the ShareGPT/HumanEval pairing, fitting the
context, the length scaling, arrivals and traces."""

from __future__ import annotations

import json
import statistics

import pytest

from pdserve.loadgen import datasets
from pdserve.loadgen.workloads import WorkloadSpec, arrival_times, make_workload, model_info

LIMIT = 200  # ShareGPT conversations read by these tests


@pytest.fixture(scope="module")
def tok():
    return model_info("smollm2-135m")


def test_sharegpt_file_is_read_to_its_cut_end():
    first = next(datasets.sharegpt_pairs())
    assert first[0].startswith("Summarize the main ideas of Jeff Walker's Product Launch")
    assert first[1].startswith("Here are the main ideas of Jeff Walker's")
    assert len(list(datasets.sharegpt_pairs(7))) == 7
    # the packaged file stops inside a conversation: every whole one is still read
    assert sum(1 for _ in datasets.iter_json_array(datasets.sharegpt_file())) > 17_000


def test_humaneval_pairs():
    pairs = datasets.humaneval_pairs()
    assert len(pairs) == 164
    assert pairs[0][0].startswith("from typing import List\n\n\ndef has_close_elements")
    assert pairs[0][1].startswith("    for idx, elem in enumerate(numbers):")


@pytest.mark.parametrize("name", ["sharegpt", "humaneval", "longprompt"])
def test_same_seed_same_requests(tok, name):
    tokenizer, max_len = tok
    spec = dict(name=name, dataset_limit=LIMIT, long_prompt_mean=300)
    a = make_workload(WorkloadSpec(**spec, seed=1), tokenizer, 12, 2.0, max_len)
    b = make_workload(WorkloadSpec(**spec, seed=1), tokenizer, 12, 2.0, max_len)
    c = make_workload(WorkloadSpec(**spec, seed=2), tokenizer, 12, 2.0, max_len)
    assert a == b and a != c
    # another rate: another sample (no rate of a sweep finds another's prompts in a
    # prefix cache), the same arrival process scaled
    d = make_workload(WorkloadSpec(**spec, seed=1), tokenizer, 12, 4.0, max_len)
    assert len(d) == len(a) and {tuple(r[1]) for r in d} != {tuple(r[1]) for r in a}
    assert d[-1].arrival_s == pytest.approx(a[-1].arrival_s / 2)


def test_sharegpt_output_length_is_the_answers_tokens(tok):
    tokenizer, max_len = tok
    reqs = make_workload(WorkloadSpec(dataset_limit=LIMIT), tokenizer, 30, 1.0, max_len)
    pairs = {tuple(tokenizer.encode(p)): a for p, a in datasets.sharegpt_pairs(LIMIT)}
    for _, ids, out in reqs:
        answer = pairs[tuple(ids)]
        assert out == len(tokenizer.backend.encode(answer, add_special_tokens=False).ids)
        assert len(ids) >= 4 and out >= 4 and len(ids) + out <= max_len


def test_humaneval_output_length_is_the_solutions_tokens(tok):
    tokenizer, max_len = tok
    solutions = {
        tuple(tokenizer.encode(p)): len(tokenizer.backend.encode(s, add_special_tokens=False).ids)
        for p, s in datasets.humaneval_pairs()
    }
    reqs = make_workload(WorkloadSpec("humaneval"), tokenizer, 200, 1.0, max_len)  # > 164
    assert all(solutions[tuple(ids)] == out for _, ids, out in reqs)


def test_scaling_caps_and_context(tok):
    tokenizer, _ = tok
    spec = WorkloadSpec(
        dataset_limit=LIMIT,
        prompt_scale=0.5,
        output_scale=0.25,
        max_prompt_tokens=64,
        max_output_tokens=16,
    )
    reqs = make_workload(spec, tokenizer, 40, 1.0, max_model_len=72)
    assert all(len(ids) <= 64 and out <= 16 and len(ids) + out <= 72 for _, ids, out in reqs)
    full = make_workload(WorkloadSpec(dataset_limit=LIMIT), tokenizer, 40, 1.0, 8192)
    assert max(len(r[1]) for r in full) > 64


def test_longprompt_lengths(tok):
    tokenizer, max_len = tok
    spec = WorkloadSpec("longprompt", dataset_limit=LIMIT)
    reqs = make_workload(spec, tokenizer, 40, 1.0, max_len)
    assert 1200 < statistics.mean(len(r[1]) for r in reqs) < 1800
    assert 70 < statistics.mean(r[2] for r in reqs) < 110
    short = make_workload(spec, tokenizer, 5, 1.0, max_model_len=512)
    assert all(len(ids) + out <= 512 for _, ids, out in short)


def test_arrivals_rate_and_burstiness():
    n = 4000
    for burstiness in (1.0, 0.25, 4.0):
        t = arrival_times(n, rate=5.0, burstiness=burstiness, seed=3)
        gaps = [b - a for a, b in zip(t, t[1:], strict=False)]
        assert t[0] == 0 and statistics.mean(gaps) == pytest.approx(0.2, rel=0.1)
        # Gamma(k, 1/(rate k)): coefficient of variation 1/sqrt(k)
        cv = statistics.stdev(gaps) / statistics.mean(gaps)
        assert cv == pytest.approx(burstiness**-0.5, rel=0.15)
    assert arrival_times(3, float("inf")) == [0.0, 0.0, 0.0]


def test_trace(tok, tmp_path):
    tokenizer, max_len = tok
    path = tmp_path / "trace.jsonl"
    rows = [
        {"timestamp": 10.0, "prompt": "Hello there", "output_len": 5},
        {"timestamp": 12.0, "prompt_len": 50, "output_tokens": 7},
        {"timestamp": 14.0, "prompt_len": 20, "output_len": 3},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    spec = WorkloadSpec("trace", trace=str(path), dataset_limit=LIMIT)
    reqs = make_workload(spec, tokenizer, 5, rate=1.0, max_model_len=max_len)
    assert [r.arrival_s for r in reqs] == pytest.approx([0, 1, 2, 3, 4])  # mean gap 2 s -> 1 s
    assert reqs[0].prompt_token_ids == tokenizer.encode("Hello there")
    assert [len(r.prompt_token_ids) for r in reqs[1:]] == [50, 20, len(reqs[0][1]), 50]
    assert [r.output_len for r in reqs] == [5, 7, 3, 5, 7]
    # another rate: the same lengths; the text filling prompt_len is another sample
    other = make_workload(spec, tokenizer, 5, rate=2.0, max_model_len=max_len)
    assert [len(r.prompt_token_ids) for r in other] == [len(r.prompt_token_ids) for r in reqs]
    assert other[0] == reqs[0]._replace(arrival_s=0.0)  # a prompt given as text repeats
    assert other[1].prompt_token_ids[:16] != reqs[1].prompt_token_ids[:16]
    with pytest.raises(ValueError, match="output_len"):
        path.write_text('{"time": 1, "prompt": "x"}\n')
        datasets.read_trace(path)
