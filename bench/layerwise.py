"""How much of the KV transfer layer-wise sending hides, on the embedded model.

    .venv/bin/python -m pdserve.bench.layerwise [--prompt-tokens 128,512,2048] [--runs 3]
                                        [--backend gloo] [--model smollm2-135m]

One run launches three local clusters in turn, each serving the same prompts
(max_tokens=1, so TTFT is the whole request): one co-located instance (the prompt
prefilled where it decodes: no transfer), and 1 prefill + 1 decode instance with
``kv_transfer.layerwise`` off (every layer sent after the forward pass) and on (each
layer sent as soon as it is computed). Every instance has 1 CPU. TTFT is measured at
the client (median of ``--runs`` after one warm-up request per cluster).

    exposed transfer = TTFT(disaggregated) - TTFT(co-located)
    hidden           = 1 - exposed(layer-wise) / exposed(whole)
    handoff          = first token at the router - first token sampled on the prefill
                       instance (the request's phase times; disaggregated only)

The handoff needs no second cluster to compare against, so the run-to-run swings of a
one-core prefill (several percent of seconds) do not hide it.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

MODES = {
    "co-located": {"mode": "colocated", "colocated": {"instances": 1}},
    "disagg, whole": {"mode": "disaggregated", "kv_transfer": {"layerwise": False}},
    "disagg, layer-wise": {"mode": "disaggregated", "kv_transfer": {"layerwise": True}},
}


def config(model: str, mode: dict, backend: str) -> dict:
    pool = {
        "instances": 1,
        "max_batch_tokens": 2048,
        "kv_blocks": 512,
        "resources": {"num_cpus": 1},
    }
    base = {
        "model": model,
        "router": {"host": "127.0.0.1", "port": 0, "http_port": 0},
        "prefill": dict(pool),
        "decode": dict(pool),
        "colocated": dict(pool),
        "kv_transfer": {"backend": backend, "lease_s": 120},
    }
    base["mode"] = mode["mode"]
    for key in ("colocated", "kv_transfer"):
        base[key] = {**base[key], **mode.get(key, {})}
    return base


def measure(model: str, mode: dict, backend: str, prompts: dict, runs: int) -> dict:
    from pdserve.cluster import launch

    out = {}
    with launch(config(model, mode, backend)) as cluster, cluster.client() as client:
        client.complete(prompt_token_ids=prompts[min(prompts)], max_tokens=1)  # warm-up
        for n, ids in prompts.items():
            ttft, transfer, handoff, kv = [], [], [], 0
            for _ in range(runs):
                started = time.perf_counter()
                done = client.complete(prompt_token_ids=ids, max_tokens=1, ignore_eos=True)
                ttft.append((time.perf_counter() - started) * 1000)
                transfer.append(done.timings.transfer_ms)
                kv = done.timings.kv_bytes
                phases = done.timings.phases
                handoff.append(phases["tokens"][0] - phases.get("prefill_end", 0.0))
            out[n] = {
                "ttft_ms": statistics.median(ttft),
                "transfer_ms": statistics.median(transfer),
                "handoff_ms": statistics.median(handoff),
                "kv_mb": kv / 1e6,
            }
            print(f"  {n:5d} tokens: TTFT {out[n]['ttft_ms']:8.1f} ms", flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt-tokens", default="128,512,2048")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--backend", default="gloo", choices=("gloo", "grpc"))
    p.add_argument("--model", default="smollm2-135m")
    args = p.parse_args(argv)
    rng = random.Random(0)
    lengths = [int(n) for n in args.prompt_tokens.split(",")]
    prompts = {n: [rng.randrange(100, 40000) for _ in range(n)] for n in lengths}
    results = {}
    for name, mode in MODES.items():
        print(f"{name} ({args.backend}) ...", flush=True)
        results[name] = measure(args.model, mode, args.backend, prompts, args.runs)
    local, whole, lw = (results[m] for m in MODES)
    print(
        "\n| prompt tokens | KV MB | TTFT co-located ms | TTFT disagg whole ms | "
        "TTFT disagg layer-wise ms | exposed whole ms | exposed layer-wise ms | hidden | "
        "handoff whole ms | handoff layer-wise ms |\n"
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    for n in lengths:
        exp_whole = whole[n]["ttft_ms"] - local[n]["ttft_ms"]
        exp_lw = lw[n]["ttft_ms"] - local[n]["ttft_ms"]
        hidden = 1 - exp_lw / exp_whole if exp_whole > 0 else float("nan")
        print(
            f"| {n} | {whole[n]['kv_mb']:.1f} | {local[n]['ttft_ms']:.1f} | "
            f"{whole[n]['ttft_ms']:.1f} | {lw[n]['ttft_ms']:.1f} | {exp_whole:.1f} | "
            f"{exp_lw:.1f} | {hidden:.0%} | {whole[n]['handoff_ms']:.1f} | "
            f"{lw[n]['handoff_ms']:.1f} |"
        )


if __name__ == "__main__":
    main()
