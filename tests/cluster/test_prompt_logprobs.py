"""Prompt logprobs through real clusters, against HF transformers' log-softmax over the
same prompt on the same weights (the tiny chat Llama, float32):

- OpenAI's ``echo`` with ``logprobs`` (the official client, completions), vLLM's
  ``prompt_logprobs`` (HTTP, streamed and not) and the gRPC client's ``prompt_logprobs``
  each give every prompt token after the first its logprob within 1e-4 of HF's, the
  same top ids, and its rank;
- co-located, and disaggregated over gloo and gRPC, with prompts longer than a
  prefill chunk (computed in the chunked prefill, carried in the KV handoff to the
  decode instance, sent with the first token);
- a prompt sent twice gets the same numbers twice: the second is computed, not served
  from the prefix cache (a cache hit has no logits);
- a stream whose decode instance is SIGKILLed mid-way got them once, first, and ends as
  the uninterrupted run (the resumed attempt computes none)."""

from __future__ import annotations

import os
import signal
import threading

import openai
import pytest
import torch

from tests.cluster.helpers import seconds_until_blocks_free, small_cluster_config, wait_until
from tests.cluster.test_disagg import disagg_config
from tests.cluster.test_supervision import SUPERVISOR, back_in_service, busiest

TOP = 3
PROMPTS = [  # longer than a chunk (64 co-located, 128 disaggregated), and short ones
    torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    for n in (150, 40, 2)
]


@pytest.fixture(scope="module")
def hf_logprobs(chat_model) -> list[torch.Tensor]:
    """Per prompt: HF's log-softmax [len - 1, vocab], row i scoring prompt token i + 1."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(chat_model, dtype=torch.float32).eval()
    with torch.no_grad():
        return [
            torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1].float(), -1) for ids in PROMPTS
        ]


def check(ids: list[int], want: torch.Tensor, got: list[tuple[int, float, list[int], int | None]]):
    """``got``: per prompt token after the first, (token id, logprob, top ids, rank)."""
    assert len(got) == len(ids) - 1
    for i, (token, logprob, top, rank) in enumerate(got):
        row = want[i]
        assert token == ids[i + 1]
        assert abs(logprob - row[token].item()) <= 1e-4, (i, logprob, row[token].item())
        assert top == row.topk(TOP).indices.tolist(), i
        if rank is not None:
            assert rank == int((row > row[token]).sum()) + 1, i


def config_of(shape: str, model: str) -> dict:
    if shape == "colocated":
        config = small_cluster_config(model)
        config["colocated"]["max_batch_tokens"] = 64
        return config
    config = disagg_config(model, shape, shape == "gloo", 1)
    config["prefill"]["resources"] = {"num_cpus": 0.5}
    config["decode"]["resources"] = {"num_cpus": 0.5}
    return config


@pytest.mark.parametrize("shape", ["colocated", "gloo", "grpc"])
def test_prompt_logprobs_are_hfs_everywhere(chat_model, hf_logprobs, shape, on_shared_ray):
    from pdserve.cluster import launch

    with (
        launch(config_of(shape, chat_model)) as cluster,
        openai.OpenAI(base_url=f"http://{cluster.http_address}/v1", api_key="-") as api,
        cluster.client() as client,
    ):
        for ids, want in zip(PROMPTS, hf_logprobs, strict=True):
            for _ in range(2):  # the second time, the prompt's blocks are in the cache
                echo = api.completions.create(
                    model=chat_model, prompt=ids, max_tokens=2, echo=True, logprobs=TOP,
                    temperature=0,
                )  # fmt: skip
                lp = echo.choices[0].logprobs
                assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
                n = len(ids)
                assert len(lp.token_logprobs) == n + 2 and lp.text_offset[0] == 0
                for i in range(1, n):
                    row = want[i - 1]
                    assert abs(lp.token_logprobs[i] - row[ids[i]].item()) <= 1e-4
                    # the legacy form names tokens by their text, and byte tokens that are
                    # not UTF-8 share one: its values are HF's top ones or the token's own
                    values = torch.tensor([*row.topk(TOP).values.tolist(), row[ids[i]].item()])
                    for value in lp.top_logprobs[i].values():
                        assert (values - value).abs().min() <= 1e-4, (i, value, values)
                    assert abs(max(lp.top_logprobs[i].values()) - values.max()) <= 1e-4
                for stream in (False, True):
                    got = api.completions.create(
                        model=chat_model, prompt=ids, max_tokens=2, temperature=0,
                        stream=stream, extra_body={"prompt_logprobs": TOP},
                    )  # fmt: skip
                    first = next(iter(got)) if stream else got
                    listed = first.choices[0].prompt_logprobs
                    assert listed[0] is None and len(listed) == n
                    rows = []
                    for i, entry in enumerate(listed[1:], 1):
                        token = entry[str(ids[i])]
                        top = [int(k) for k, v in entry.items() if v["rank"] <= TOP]
                        top.sort(key=lambda k: entry[str(k)]["rank"])
                        rows.append((ids[i], token["logprob"], top[:TOP], token["rank"]))
                    check(ids, want, rows)
                done = client.complete(
                    prompt_token_ids=ids, max_tokens=2, temperature=0, prompt_logprobs=TOP
                )
                plp = done.prompt_logprobs or []
                check(ids, want, [(p.token_id, p.logprob, list(p.top_ids), p.rank) for p in plp])
        seconds_until_blocks_free(cluster)


def test_a_stream_migrated_mid_way_got_its_prompt_logprobs_once(
    chat_model, hf_logprobs, on_shared_ray
):
    """Streams asking for prompt logprobs, the decode instance holding most of them
    SIGKILLed once each has 8 tokens: each got the prompt's logprobs once, in its first
    chunk (the resumed attempt, whose client has them, computes none), and ends as the
    uninterrupted run."""
    from pdserve.cluster import launch
    from pdserve.engine import LLM, SamplingParams

    ids, want, streams = PROMPTS[0], hf_logprobs[0], 3
    params = SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)
    tokens_want = LLM(chat_model).generate([ids], params)[0].token_ids
    config = disagg_config(chat_model, "gloo", True, 1)
    config["decode"].update(instances=2, resources={"num_cpus": 0.5})
    config["supervisor"] = SUPERVISOR
    with launch(config) as cluster, cluster.client() as client:
        chunks: list[list] = [[] for _ in range(streams)]
        errors: list = []

        def read(i: int) -> None:
            try:
                for chunk in client.generate(
                    prompt_token_ids=ids, max_tokens=300, temperature=0, ignore_eos=True,
                    prompt_logprobs=TOP,
                ):  # fmt: skip
                    chunks[i].append(chunk)
            except Exception as e:  # reported by the test
                errors.append(e)

        threads = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(streams)]
        for t in threads:
            t.start()
        count = lambda: min(sum(len(c.token_ids) for c in got) for got in chunks)  # noqa: E731
        assert wait_until(lambda: count() >= 1, 60)
        victim, pid = busiest(cluster, "decode")
        assert wait_until(lambda: count() >= 8, 60)
        os.kill(pid, signal.SIGKILL)
        for t in threads:
            t.join(120)
        assert not errors, errors
        migrated = 0
        for got in chunks:
            assert [t for c in got for t in c.token_ids] == tokens_want
            with_prompt = [c for c in got if c.prompt_logprobs is not None]
            assert with_prompt == [got[0]]
            plp = got[0].prompt_logprobs
            check(ids, want, [(p.token_id, p.logprob, list(p.top_ids), p.rank) for p in plp])
            migrated += got[-1].timings.attempts > 1
        assert migrated, "no stream was on the killed decode instance"
        back_in_service(cluster, victim)
        seconds_until_blocks_free(cluster)
