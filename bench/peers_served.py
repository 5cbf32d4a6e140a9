"""The served half of ``bench/peers.py``: one server at a time on loopback (``vllm
serve`` with its CPU defaults, or a pdserve cluster), warmed up, then driven by NVIDIA
AIPerf at each rate of the sweep, and stopped before the next server starts.

The workload is the same for every server: at each rate, ``round(rate x duration)``
chat requests (at least ``MIN_REQUESTS``), each a prompt of ``prompt_tokens`` random
words that the model's tokenizer reads as exactly that many tokens (the chat template
adds its own around them), greedy, ``ignore_eos``, ``output_tokens`` tokens, streamed;
Poisson arrivals (the sample scaled to the rate). Prompts and arrivals are drawn from
a seed naming the rate: every server gets the same requests at the same times, and no
rate's prompts are another's (a prefix cache cannot carry over). AIPerf replays the
file with ``--fixed-schedule`` (``bench/aiperf_run.py``) and reports, from the client:
completed requests/s and output tokens/s over its run, TTFT and ITL (per request,
(latency - TTFT) / (tokens - 1)) percentiles, and the requests that met both
objectives (its ``--goodput``).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import random
import signal
import socket
import subprocess
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pdserve.bench import aiperf_run
from pdserve.bench.peers_offline import clean_env, vllm_isa_env
from pdserve.loadgen.metrics import SLO

MODEL = "smollm2-135m"
MIN_REQUESTS = 10
VLLM_READY_TIMEOUT_S = 900.0
WARMUP_REQUESTS = 4


def prompt_words(tokenizer_json: Path) -> list[str]:
    """Lowercase ASCII words that are one token each with their leading space: a string
    of N of them is N tokens (a byte-level BPE splits at the spaces first)."""
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(tokenizer_json)).get_vocab()
    return sorted(
        k[1:]
        for k in vocab
        if k[0] == "Ġ" and len(k) >= 4 and k[1:].isascii() and k[1:].isalpha() and k[1:].islower()
    )


def workload(words: list[str], rate: float, n: int, prompt_tokens: int) -> list[tuple[float, str]]:
    """(arrival s, prompt text) of n requests at ``rate``: exponential gaps from 0,
    scaled so that the last arrives at (n - 1) / rate (the rate offered is ``rate``, not
    a small sample's)."""
    rng = random.Random(f"peers/{rate:g}")
    gaps = [rng.expovariate(1.0) for _ in range(n - 1)]
    scale = (n - 1) / rate / sum(gaps) if gaps else 0.0
    arrivals = [0.0, *itertools.accumulate(g * scale for g in gaps)]
    texts = ["".join(" " + rng.choice(words) for _ in range(prompt_tokens)) for _ in range(n)]
    return list(zip(arrivals, texts, strict=True))


def write_inputs(path: Path, requests: list[tuple[float, str]], output_tokens: int) -> None:
    """AIPerf's ``single_turn`` JSONL: the text is the user message of a chat request."""
    with open(path, "w") as f:
        for arrival_s, text in requests:
            extra = {"temperature": 0.0, "ignore_eos": True}
            line = {
                "text": text,
                "timestamp": arrival_s * 1e3,
                "output_length": output_tokens,
                "extra": extra,
            }
            f.write(json.dumps(line) + "\n")


def read_run(folder: Path, rate: float) -> dict:
    """One rate's figures from AIPerf's summary (``profile_export_aiperf.json``)."""
    s = json.loads((folder / "profile_export_aiperf.json").read_text())

    def get(tag: str, stat: str = "avg") -> float | None:
        return (s.get(tag) or {}).get(stat)

    return {
        "rate": rate,
        "requests": int(get("request_count") or 0) + int(get("error_request_count") or 0),
        "completed": int(get("request_count") or 0),
        "errors": int(get("error_request_count") or 0),
        "completed_req_s": get("request_throughput") or 0.0,
        "output_tok_s": get("output_token_throughput") or 0.0,
        "ttft_p50_ms": get("time_to_first_token", "p50"),
        "ttft_p90_ms": get("time_to_first_token", "p90"),
        "itl_p50_ms": get("inter_token_latency", "p50"),
        "itl_p90_ms": get("inter_token_latency", "p90"),
        "good": int(get("good_request_count") or 0),
        "goodput_req_s": get("goodput") or 0.0,
        "prompt_tokens_mean": get("input_sequence_length"),
    }


def describe(name: str, r: dict) -> str:
    def ms(key: str) -> str:
        return "-" if r[key] is None else f"{r[key]:.0f}"

    return (
        f"served: {name} at {r['rate']:g}/s: {r['completed']}/{r['requests']} completed "
        f"({r['errors']} failed), {r['completed_req_s']:.2f} req/s, {r['output_tok_s']:.1f} "
        f"tok/s, TTFT p50/p90 {ms('ttft_p50_ms')}/{ms('ttft_p90_ms')} ms, ITL p50/p90 "
        f"{ms('itl_p50_ms')}/{ms('itl_p90_ms')} ms, goodput {r['goodput_req_s']:.2f} req/s "
        f"({r['good']} met the SLO); prompts {ms('prompt_tokens_mean')} tokens as served"
    )


def chat(url: str, text: str, max_tokens: int) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    request = urllib.request.Request(
        f"{url}/v1/chat/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=600) as answer:
        answer.read()


def warm_up(url: str, words: list[str], prompt_tokens: int) -> None:
    """One request alone, then ``WARMUP_REQUESTS`` at once, of prompts no rate sends:
    first-request costs (compilation, packing) fall here, not on a measured request."""
    rng = random.Random("peers/warm-up")
    texts = [
        "".join(" " + rng.choice(words) for _ in range(prompt_tokens))
        for _ in range(WARMUP_REQUESTS + 1)
    ]
    chat(url, texts[0], 16)
    with ThreadPoolExecutor(WARMUP_REQUESTS) as pool:
        list(pool.map(lambda t: chat(url, t, 16), texts[1:]))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def vllm_server(venv: Path, folder: Path, log_path: Path):
    """``vllm serve`` (float32, its CPU defaults) on a free loopback port; yields its URL,
    then stops its whole process group."""
    port = free_port()
    cmd = [
        str(venv / "bin" / "vllm"),
        "serve",
        str(folder),
        "--dtype",
        "float32",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        MODEL,
    ]
    env = clean_env(VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="4", **vllm_isa_env())
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + VLLM_READY_TIMEOUT_S
            while not _answers(f"{url}/v1/models"):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"vllm serve did not come up; see {log_path}")
                time.sleep(2)
            yield url
        finally:
            _stop_group(proc)


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            return answer.status == 200
    except OSError:
        return False


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the process group, then after at most 60 s SIGKILL to what is left of
    it (vLLM's engine process outlives its API server otherwise)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=60)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@contextlib.contextmanager
def pdserve_server(config: str, overrides: list[str]):
    """A pdserve cluster of ``config`` with ``overrides`` on free loopback ports; yields
    its HTTP URL, then shuts it down (Ray included)."""
    from pdserve.cluster.launcher import launch
    from pdserve.loadgen.runner import QUIET

    loopback = ["router.host=127.0.0.1", "router.port=0", "router.http_port=0"]
    cluster = launch(config, [*overrides, *loopback, QUIET])
    try:
        yield f"http://{cluster.http_address}"
    finally:
        cluster.shutdown(drain=False)


def sweep(name: str, url: str, words: list[str], args, folder: Path, out: Path, log) -> dict:
    """Warm-up, then AIPerf at every rate of ``args.rates``: ``{"runs": [read_run ...]}``."""
    started = time.monotonic()
    warm_up(url, words, args.prompt_tokens)
    log(f"served: {name} warmed up in {time.monotonic() - started:.0f} s")
    slo, runs = SLO(args.slo_ttft_ms, args.slo_itl_ms), []
    for rate in args.rates:
        n = max(MIN_REQUESTS, round(rate * args.duration))
        inputs, run_dir = out / f"inputs-{rate:g}.jsonl", out / f"aiperf-{name}-{rate:g}"
        write_inputs(inputs, workload(words, rate, n, args.prompt_tokens), args.output_tokens)
        log(f"served: {name} at {rate:g}/s: {n} requests (AIPerf, log {run_dir}.log)")
        cmd = aiperf_run.command(
            args.aiperf, url, MODEL, folder, inputs, run_dir, slo, endpoint_type="chat"
        )
        code = aiperf_run.Running(cmd, run_dir.with_suffix(".log"), log).wait()
        if code != 0:
            raise RuntimeError(f"aiperf exited with {code}; see {run_dir}.log")
        runs.append(read_run(run_dir, rate))
        log(describe(name, runs[-1]))
    return {"runs": runs}
