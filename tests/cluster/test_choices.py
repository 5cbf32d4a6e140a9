"""Several choices (``n``) through real clusters: co-located, and disaggregated over
gloo and gRPC.

- ``n = 4`` with a seed (the official ``openai`` client, completions and chat, streamed
  and not; and gRPC): each choice equals the same request run alone with that choice's
  seed (seed + i);
- the prompt's KV is computed once (the instances' ``prompt_tokens_computed_total``
  grows by the prompt, not four prompts) and, disaggregated, transferred once (the
  decode instance's ``kv_bytes_total`` grows by one prompt's KV, the layout formula);
- usage counts the prompt once and every choice's tokens;
- ``best_of`` past ``n``: the n choices with the highest mean logprob of the best_of
  the same request generates with ``n = best_of`` (ranked from their logprobs);
- a stream of n choices whose decode instance is SIGKILLed mid-way: every choice ends
  as the uninterrupted run (each migrates alone);
- every block is free after each scenario."""

from __future__ import annotations

import os
import signal
import statistics
import threading
from collections import defaultdict

import grpc
import openai
import pytest

from tests.cluster.helpers import seconds_until_blocks_free, wait_until
from tests.cluster.test_disagg import disagg_config
from tests.cluster.test_prompt_logprobs import config_of
from tests.cluster.test_supervision import SUPERVISOR, back_in_service, busiest

PROMPT = list(range(40, 80))  # 40 tokens: two full blocks of 16 and a partial one
SEED, N = 1234, 4
SAMPLED = dict(max_tokens=12, temperature=0.9, extra_body={"ignore_eos": True})


def totals(cluster, key: str, role: str) -> int:
    return sum(i[key] for i in cluster.stats()["instances"] if i["role"] == role)


def kv_bytes(tokens: int) -> int:
    """One prompt's KV as the tiny chat Llama's layout moves it: 2 layers, K and V, whole
    blocks of 16 tokens, 2 KV heads of 16, float32."""
    return 2 * 2 * -(-tokens // 16) * 16 * 2 * 16 * 4


def grpc_choices(cluster, n: int) -> dict[int, str]:
    """The text of each choice of one gRPC request of ``n`` choices."""
    from pdserve.router import pdserve_pb2_grpc as pb_grpc
    from pdserve.router.client_types import make_request

    request = make_request(prompt_token_ids=PROMPT, max_tokens=12, temperature=0.9, seed=SEED,
                           ignore_eos=True)  # fmt: skip
    request.sampling.n = n
    texts: dict[int, str] = defaultdict(str)
    ends = {}
    with grpc.insecure_channel(cluster.address) as channel:
        for msg in pb_grpc.RouterStub(channel).Generate(request, timeout=60):
            texts[msg.index] += msg.text
            if msg.finish_reason:
                ends[msg.index] = msg.finish_reason
    assert ends == {i: "length" for i in range(n)}
    return dict(texts)


def config(shape: str, model: str) -> dict:
    """``config_of``'s shapes, and hybrid: two decode instances that prefill for each
    other or themselves, no prefill pool."""
    if shape != "hybrid":
        return config_of(shape, model)
    hybrid = disagg_config(model, "gloo", True, 0)
    hybrid["mode"] = "hybrid"
    hybrid["decode"].update(instances=2, resources={"num_cpus": 0.5})
    return hybrid


@pytest.mark.parametrize("shape", ["colocated", "gloo", "grpc", "hybrid"])
def test_each_choice_is_the_request_alone_with_its_seed(chat_model, shape, on_shared_ray):
    from pdserve.cluster import launch

    prompt_role = {"colocated": "colocated", "hybrid": "decode"}.get(shape, "prefill")
    with (
        launch(config(shape, chat_model)) as cluster,
        openai.OpenAI(base_url=f"http://{cluster.http_address}/v1", api_key="-") as api,
    ):
        computed = totals(cluster, "prompt_tokens_computed_total", prompt_role)
        moved = 0 if shape == "colocated" else totals(cluster, "kv_bytes_total", "decode")
        got = api.completions.create(model=chat_model, prompt=PROMPT, n=N, seed=SEED, **SAMPLED)
        # the first request here: no prefix cache hit anywhere, so all of it is computed
        assert totals(cluster, "prompt_tokens_computed_total", prompt_role) - computed == 40
        if shape in ("gloo", "grpc"):
            assert totals(cluster, "kv_bytes_total", "decode") - moved == kv_bytes(40)
        if shape == "hybrid":  # its prompt computed by itself (nothing moved) or a peer
            # (sent and received: counted by both)
            assert totals(cluster, "kv_bytes_total", "decode") - moved in (0, 2 * kv_bytes(40))
        assert [c.index for c in got.choices] == list(range(N))
        assert got.usage.prompt_tokens == 40 and got.usage.completion_tokens == 12 * N
        texts = [c.text for c in got.choices]
        assert len(set(texts)) > 1  # sampled: the seeds differ
        for i, text in enumerate(texts):
            alone = api.completions.create(
                model=chat_model, prompt=PROMPT, seed=SEED + i, **SAMPLED
            )
            assert alone.choices[0].text == text, i
        streamed: dict[int, str] = defaultdict(str)
        for chunk in api.completions.create(
            model=chat_model, prompt=PROMPT, n=N, seed=SEED, stream=True, **SAMPLED
        ):
            for c in chunk.choices:
                streamed[c.index] += c.text
        assert [streamed[i] for i in range(N)] == texts
        assert [grpc_choices(cluster, N)[i] for i in range(N)] == texts
        # best_of: the N choices generated, the 2 with the highest mean logprob returned
        scored = api.completions.create(
            model=chat_model, prompt=PROMPT, n=N, seed=SEED, logprobs=0, **SAMPLED
        )
        assert [c.text for c in scored.choices] == texts  # logprobs change no draw
        means = [statistics.fmean(c.logprobs.token_logprobs) for c in scored.choices]
        ranked = sorted(range(N), key=lambda i: -means[i])
        best = api.completions.create(
            model=chat_model, prompt=PROMPT, n=2, best_of=N, seed=SEED, **SAMPLED
        )
        assert [(c.index, c.text) for c in best.choices] == [
            (0, texts[ranked[0]]),
            (1, texts[ranked[1]]),
        ]
        assert all(c.logprobs is None for c in best.choices)  # not asked: not shown
        assert best.usage.completion_tokens == 12 * N  # every choice generated
        chat = api.chat.completions.create(
            model=chat_model, messages=[{"role": "user", "content": "Name a color."}], n=3,
            seed=SEED, **SAMPLED,
        )  # fmt: skip
        for i, c in enumerate(chat.choices):
            alone = api.chat.completions.create(
                model=chat_model, messages=[{"role": "user", "content": "Name a color."}],
                seed=SEED + i, **SAMPLED,
            )  # fmt: skip
            assert (c.index, c.message.content) == (i, alone.choices[0].message.content)
        seconds_until_blocks_free(cluster)


def test_choices_migrated_mid_way_end_as_uninterrupted(chat_model, on_shared_ray):
    """A request of three greedy choices whose decode instance is SIGKILLed once each
    choice has 8 tokens: each migrates alone and ends as the uninterrupted run."""
    from pdserve.cluster import launch

    config = disagg_config(chat_model, "gloo", True, 1)
    config["decode"].update(instances=2, resources={"num_cpus": 0.5})
    config["supervisor"] = SUPERVISOR
    body = dict(model=chat_model, prompt=PROMPT, max_tokens=200, temperature=0,
                extra_body={"ignore_eos": True})  # fmt: skip
    with (
        launch(config) as cluster,
        openai.OpenAI(base_url=f"http://{cluster.http_address}/v1", api_key="-") as api,
    ):
        want = api.completions.create(**body).choices[0].text
        texts: dict[int, str] = defaultdict(str)
        errors: list = []

        def read() -> None:
            try:
                for chunk in api.completions.create(n=3, stream=True, **body):
                    for c in chunk.choices:
                        texts[c.index] += c.text
            except Exception as e:  # reported by the test
                errors.append(e)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        assert wait_until(lambda: len(texts) == 3 and min(map(len, texts.values())) >= 8, 60)
        victim, pid = busiest(cluster, "decode")
        os.kill(pid, signal.SIGKILL)
        reader.join(120)
        assert not errors, errors
        assert [texts[i] for i in range(3)] == [want] * 3
        back_in_service(cluster, victim)
        seconds_until_blocks_free(cluster)
