"""The multiturn and sharedprefix workloads (SmolLM2's tokenizer and chat template, the
real ShareGPT file): determinism per seed and rate, turns that extend the previous
prompt + answer token for token, think times, fitting; and the closed-loop replay
through a real cluster of the tiny chat model."""

from __future__ import annotations

import asyncio
import math
import statistics
from pathlib import Path

import pytest

from pdserve.cluster import launch
from pdserve.loadgen.chat_replay import replay_conversations
from pdserve.loadgen.multiturn import build_conversation, make_conversations, turn_prompts
from pdserve.loadgen.workloads import WorkloadSpec, make_workload, model_info
from tests.cluster.helpers import small_cluster_config

LIMIT = 300  # ShareGPT conversations read by these tests
EXCHANGES = [
    ("What is the capital of France?", "The capital of France is Paris."),
    ("And of Italy?", "Rome is the capital of Italy."),
    ("Which one is larger?", "Rome has more inhabitants than Paris proper."),
]


@pytest.fixture(scope="module")
def tok():
    return model_info("smollm2-135m")


def messages(users: list[str], answers: list[str]) -> list[dict]:
    out = []
    for k, user in enumerate(users):
        out.append({"role": "user", "content": user})
        if k < len(answers):
            out.append({"role": "assistant", "content": answers[k]})
    return out


@pytest.mark.timeout(120)
def test_turns_extend_the_previous_prompt_and_answer_token_for_token(tok):
    tokenizer, max_len = tok
    conv = build_conversation(WorkloadSpec("multiturn"), tokenizer, 0, EXCHANGES, max_len)
    assert [t.output_len for t in conv.turns] == [
        len(tokenizer.backend.encode(a, add_special_tokens=False).ids) for _, a in EXCHANGES
    ]
    # whatever the server answers (here arbitrary ids): prompt k + answer k is a prefix
    odd = [[5000 + k, 17, 42 + k] for k in range(3)]
    prompts = turn_prompts(conv, odd)
    for k in range(2):
        assert prompts[k + 1][: len(prompts[k]) + 3] == prompts[k] + odd[k]
    # answers that are their text's tokens: exactly the chat template's rendering
    texts = ["Paris, of course.", "It is Rome."]
    answers = [tokenizer.backend.encode(t, add_special_tokens=False).ids for t in texts]
    for k, prompt in enumerate(turn_prompts(conv, [*answers, []])):
        users = [u for u, _ in EXCHANGES[: k + 1]]
        rendered = tokenizer.apply_chat_template(messages(users, texts[:k]))
        assert prompt == tokenizer.encode(rendered)


@pytest.mark.timeout(120)
def test_caps_cut_a_conversation_and_its_outputs(tok):
    tokenizer, max_len = tok
    full = turn_prompts(
        build_conversation(WorkloadSpec("multiturn"), tokenizer, 0, EXCHANGES, max_len),
        [[1] * 3] * 3,
    )
    spec = WorkloadSpec("multiturn", max_output_tokens=3, max_prompt_tokens=len(full[1]))
    conv = build_conversation(spec, tokenizer, 0, EXCHANGES, max_len)
    assert [t.output_len for t in conv.turns] == [3, 3]  # turn 2's prompt is too long
    assert [len(t.planned_answer) for t in conv.turns] == [3, 3]
    two = build_conversation(WorkloadSpec("multiturn", max_turns=2), tokenizer, 0, EXCHANGES, 999)
    assert len(two.turns) == 2
    assert build_conversation(spec, tokenizer, 0, EXCHANGES, len(full[0])) is None


@pytest.mark.timeout(120)
def test_think_times_are_seeded_exponential_after_the_first_turn(tok):
    tokenizer, max_len = tok
    spec = WorkloadSpec("multiturn", think_time_s=4.0, seed=3)
    convs = [build_conversation(spec, tokenizer, i, EXCHANGES, max_len) for i in range(150)]
    thinks = [t.think_s for c in convs for t in c.turns[1:]]
    assert all(c.turns[0].think_s == 0 for c in convs)
    assert statistics.mean(thinks) == pytest.approx(4.0, rel=0.2)
    again = build_conversation(spec, tokenizer, 7, EXCHANGES, max_len)
    assert again == convs[7]
    none = build_conversation(
        WorkloadSpec("multiturn", think_time_s=0), tokenizer, 0, EXCHANGES, 99
    )
    assert {t.think_s for t in none.turns} == {0.0}


@pytest.mark.timeout(180)
def test_conversations_are_seeded_by_the_seed_and_the_rate(tok):
    tokenizer, max_len = tok
    spec = dict(name="multiturn", dataset_limit=LIMIT, max_output_tokens=16)
    a = make_conversations(WorkloadSpec(**spec, seed=1), tokenizer, 6, 2.0, max_len)
    assert a == make_conversations(WorkloadSpec(**spec, seed=1), tokenizer, 6, 2.0, max_len)
    assert a != make_conversations(WorkloadSpec(**spec, seed=2), tokenizer, 6, 2.0, max_len)
    other = make_conversations(WorkloadSpec(**spec, seed=1), tokenizer, 6, 4.0, max_len)
    assert [c.turns for c in other] != [c.turns for c in a]  # no prefix left from 2/s
    assert all(2 <= len(c.turns) <= 5 for c in a)
    assert [c.arrival_s for c in a] == sorted(c.arrival_s for c in a) and a[0].arrival_s == 0
    for c in a:
        for p in turn_prompts(c, [t.planned_answer for t in c.turns]):
            assert len(p) + 16 <= max_len
    with pytest.raises(ValueError, match="closed-loop"):
        make_workload(WorkloadSpec(**spec), tokenizer, 2, 1.0, max_len)
    with pytest.raises(ValueError, match="prompt_scale 2: workload multiturn"):
        WorkloadSpec(**spec, prompt_scale=2.0)


@pytest.mark.timeout(180)
def test_sharedprefix_requests_share_few_system_prompts(tok):
    tokenizer, max_len = tok
    spec = WorkloadSpec(
        "sharedprefix", dataset_limit=LIMIT, system_prompts=3, system_prompt_tokens=200
    )
    reqs = make_workload(spec, tokenizer, 24, 2.0, max_len)
    assert reqs == make_workload(spec, tokenizer, 24, 2.0, max_len)
    heads = {tuple(r.prompt_token_ids[:60]) for r in reqs}
    assert len(heads) == 3  # every request starts with one of the 3 system prompts
    tails = {tuple(r.prompt_token_ids[-20:]) for r in reqs}
    assert len(tails) > 12  # and asks its own question
    for r in reqs:
        assert 100 <= len(r.prompt_token_ids) <= 300 + 64 + 40 and r.output_len >= 4
    later = make_workload(spec, tokenizer, 24, 4.0, max_len)
    assert not heads & {tuple(r.prompt_token_ids[:60]) for r in later}


@pytest.mark.timeout(240)
def test_closed_loop_replay_through_a_cluster(chat_model):
    tokenizer, max_len = model_info(chat_model)
    spec = WorkloadSpec(
        "multiturn",
        dataset_limit=LIMIT,
        max_prompt_tokens=250,
        max_output_tokens=4,
        think_time_s=0.3,
        max_turns=3,
    )
    convs = make_conversations(spec, tokenizer, 3, 4.0, max_len)
    cluster = launch(small_cluster_config(chat_model))
    try:
        records = asyncio.run(replay_conversations(cluster.client(), convs))
    finally:
        cluster.shutdown(drain=False)
    turns = [(c, t) for c in convs for t in c.turns]
    assert [r.index for r in records] == list(range(len(turns)))
    assert all(r.ok and r.completion_tokens == r.output_len for r in records)
    at = 0
    for c in convs:
        mine = records[at : at + len(c.turns)]
        at += len(c.turns)
        assert mine[0].prompt_tokens == len(c.turns[0].ids)
        assert mine[0].sent_s >= c.arrival_s
        for k in range(1, len(c.turns)):
            prev, rec = mine[k - 1], mine[k]
            # the prompt grew by the answer and the turn's own ids
            assert rec.prompt_tokens == prev.prompt_tokens + prev.output_len + len(c.turns[k].ids)
            # sent no sooner than the previous answer's end + the think time
            assert rec.sent_s >= prev.sent_s + prev.e2e_ms / 1000 + c.turns[k].think_s - 0.05
            assert math.isfinite(rec.ttft_ms) and rec.lag_ms < 500


@pytest.mark.timeout(60)
def test_cli_refuses_multiturn_against_an_endpoint_and_bad_options(capsys):
    from pdserve.cluster.cli import main

    config = str(Path(__file__).parents[2] / "configs" / "local-colocated.yaml")
    url = ["--endpoint", "http://127.0.0.1:1"]
    assert main(["bench", config, "--workload", "multiturn", *url]) == 2
    assert main(["compare", config, config, "--workload", "multiturn", *url]) == 2
    assert main(["bench", config, "--workload", "sharedprefix", "--prompt-scale", "2"]) == 2
    assert main(["bench", config, "--workload", "multiturn", "--max-turns", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("--workload multiturn: not with --endpoint") == 2
    assert "prompt_scale 2: workload sharedprefix builds its prompts whole" in err
    assert "max_turns 0: must be >= 1" in err
