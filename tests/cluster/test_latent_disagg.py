"""Latent and tied KV through real disaggregated clusters (Ray, the gRPC router, gloo and
gRPC KV transfer, prefill and decode instances of 1 and 2 tensor-parallel ranks): a tiny
DeepSeek-V3 (MLA: one latent, replicated on every rank) and a tiny GLA-2 (two latent
heads, one per rank at TP 2). Greedy outputs equal the offline engine's, and each request
moves exactly the bytes of kv_transfer/layout.py's rule (docs/kv_transfer.md, "Latent
caches"): every GLA decode rank receives its own row of every block of every layer once,
its latent heads and the one RoPE key; MLA's replicated row crosses the wire once per
decode instance, into rank 0, which forwards it to rank 1 over the instance's
tensor-parallel group (the greedy outputs at decode TP 2 need rank 1's copy: its query
heads read it). Then decode rank 1 of an MLA instance killed while a transfer into it
is held at its END: the request is redone on the other decode instance."""

from __future__ import annotations

import os
import signal
import threading

import pytest
import ray

from pdserve.engine import LLM, SamplingParams
from tests.cluster.helpers import all_blocks_free, wait_until
from tests.cluster.test_disagg import check_pools, disagg_config, run_concurrently
from tests.cluster.test_disagg_kill import restarted
from tests.kv_transfer.faults import ENV, write_plan

BS = 16
MAX_TOKENS = 20
# the preemption setup's answers: long enough that the four requests decode at once on
# the decode instance however fast the CPU (at 20 tokens one could end before the next
# landed, and then nothing was preempted)
PREEMPT_TOKENS = 120
PROMPTS = [
    [5 + (3 * i) % 200 for i in range(23)],
    [9 + (13 * i) % 230 for i in range(70)],
    [7, 8, 9],
    [3 + (11 * i) % 240 for i in range(150)],
]
SETUPS = [  # model, backend, prefill TP, decode TP, prefill chunk, decode KV blocks
    ("mla", "gloo", 1, 2, 7, 256),
    ("mla", "grpc", 2, 1, 1, 256),
    ("gla-2", "gloo", 2, 2, 256, 256),
    ("gla-2", "grpc", 1, 2, 7, 256),
    # 19 blocks: the prompts' 2 + 5 + 1 + 10 fit, the KV at their ends (prompt +
    # PREEMPT_TOKENS: 9 + 12 + 8 + 17 blocks) does not, so decode preempts and recomputes
    ("mla", "gloo", 1, 1, 256, 19),
]


def greedy(llm: LLM, max_tokens: int) -> list[list[int]]:
    """The offline engine's greedy answers to ``PROMPTS``."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.token_ids for o in llm.generate(PROMPTS, params)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (folder, the offline engine's greedy outputs, bytes per token a decode
    instance receives over the wire, by decode TP)."""
    from tests.latent_reference import save_tiny_gla
    from tests.tiny_models import TINY_MLA_SHAPES, save_byte_tokenizer, save_tiny_deepseek

    made = {}
    for name, save in (
        ("mla", lambda f: save_tiny_deepseek(f, **TINY_MLA_SHAPES["v3"])),
        ("gla-2", lambda f: save_tiny_gla(f, 2)),
    ):
        folder = tmp_path_factory.mktemp(f"latent-{name}")
        save(folder)
        save_byte_tokenizer(folder)
        with LLM(str(folder), enable_prefix_caching=False) as llm:
            outs = greedy(llm, MAX_TOKENS)
            cfg = llm.engine.model.cfg
        m = cfg.mla
        per_instance = {}  # every rank its row; MLA's replicated one once (rank 0 forwards)
        for tp in (1, 2):
            heads = m.latent_heads if m.replicated else m.latent_heads // tp
            row = cfg.num_layers * (heads * m.kv_lora_rank + m.qk_rope_head_dim) * 4
            per_instance[tp] = row if m.replicated else tp * row
        made[name] = (str(folder), outs, per_instance)
    return made


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "model,backend,prefill_tp,decode_tp,chunk,decode_blocks",
    SETUPS,
    ids=[f"{m}-{b}-P{p}D{d}-chunk{c}-blocks{n}" for m, b, p, d, c, n in SETUPS],
)
def test_latent_kv_hands_off_to_the_offline_greedy(
    models, model, backend, prefill_tp, decode_tp, chunk, decode_blocks
):
    from pdserve.cluster import launch

    folder, outs, per_instance = models[model]
    max_tokens = MAX_TOKENS if decode_blocks >= 256 else PREEMPT_TOKENS
    if max_tokens != MAX_TOKENS:
        with LLM(folder, enable_prefix_caching=False) as llm:
            outs = greedy(llm, max_tokens)
    config = disagg_config(folder, backend, backend == "gloo", 1)
    config["prefill"].update(tensor_parallel=prefill_tp, prefix_caching=False,
                             max_batch_tokens=chunk, resources={"num_cpus": 0.5})  # fmt: skip
    config["decode"].update(tensor_parallel=decode_tp, prefix_caching=False,
                            kv_blocks=decode_blocks, resources={"num_cpus": 0.5})  # fmt: skip
    with launch(config) as cluster:
        client = cluster.client()
        got = run_concurrently(client, [(p, max_tokens) for p in PROMPTS])
        for prompt, chunks, want in zip(PROMPTS, got, outs, strict=True):
            assert [t for c in chunks for t in c.token_ids] == want
            blocks = -(-len(prompt) // BS)
            # each decode rank's row of every block (MLA: rank 0's), whole blocks
            assert chunks[-1].timings.kv_bytes == blocks * BS * per_instance[decode_tp]
        decode = ray.get(cluster.workers["decode-0"].stats.remote())
        assert (decode["preemptions_total"] > 0) == (decode_blocks < 256), decode
        assert wait_until(lambda: all_blocks_free(client.stats()), 10), client.stats()
        check_pools(cluster)
        client.close()


@pytest.mark.timeout(300)
def test_mla_decode_rank_killed_before_the_forward_is_survived(models, tmp_path):
    """Two MLA decode instances of TP 2; the first attempt's END is held 2 s at the
    receiving rank 0 while the test kills that instance's rank 1 (SIGKILL). The
    supervisor pings only every 20 s here, so the forward's broadcast is what finds the
    rank gone: rank 0 ends the instance (ranks out of step), and the router redoes the
    request on the other decode instance with the offline greedy output; the victim is
    restarted and every instance ends with every block free."""
    from pdserve.cluster import launch

    folder, outs, _ = models["mla"]
    prompt, want, rid = PROMPTS[1], outs[1], "mla-forward-fault"
    plan = tmp_path / "plan.json"
    write_plan(plan, [{"side": "receiver", "step": "end", "action": "delay", "rank": 0,
                       "match": f"{rid}#0", "seconds": 2.0}])  # fmt: skip
    config = disagg_config(folder, "tests.kv_transfer.faults:gloo", True, 1, lease_s=20.0)
    config["prefill"].update(prefix_caching=False, resources={"num_cpus": 0.25})
    config["decode"].update(instances=2, tensor_parallel=2, prefix_caching=False,
                            resources={"num_cpus": 0.25})  # fmt: skip
    config["supervisor"] = {"heartbeat_s": 20.0}  # the forward, not a ping, finds rank 1 gone
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ENV, str(plan))
        with launch(config) as cluster, cluster.client() as client:
            got: dict = {}
            run = threading.Thread(target=lambda: got.update(done=client.complete(
                prompt_token_ids=prompt, max_tokens=MAX_TOKENS, temperature=0,
                ignore_eos=True, request_id=rid)), daemon=True)  # fmt: skip
            run.start()

            def holder() -> str | None:  # the decode instance holding the reservation
                for name in ("decode-0", "decode-1"):
                    if ray.get(cluster.workers[name].stats.remote())["reserved"]:
                        return name
                return None

            assert wait_until(lambda: holder() is not None, 30), cluster.stats()
            victim = holder()
            rank1 = ray.get_actor(f"{victim}-rank1", namespace="pdserve")
            os.kill(ray.get(rank1.ready.remote())["pid"], signal.SIGKILL)
            run.join(timeout=120)
            assert not run.is_alive(), "the request did not finish"
            done = got["done"]
            assert list(done.token_ids) == want
            assert done.timings.attempts == 2 and victim in done.timings.instances
            assert victim not in done.timings.instances[2:], done.timings.instances
            write_plan(plan, [])
            assert wait_until(lambda: restarted(cluster, victim), 120), cluster.stats()

            def settled():
                live = [s for s in cluster.stats()["instances"] if s["state"] == "serving"]
                return len(live) == 3 and all(s["free_blocks"] == s["total_blocks"] for s in live)

            assert wait_until(settled, 10), cluster.stats()
            for name, worker in cluster.workers.items():
                blocks = ray.get(worker.check_integrity.remote())
                assert blocks["free_blocks"] == blocks["total_blocks"], (name, blocks)
