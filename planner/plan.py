"""``pdserve plan``: search the placement for a model, devices, workload and SLO, print
the top candidates and why the winner wins, and write a config ``pdserve up`` loads.

    pdserve plan --model opt-13b --devices 8 --workload sharegpt \\
        --slo-ttft-ms 400 --slo-tpot-ms 100 [--hardware a100 | --profile profile.json] \\
        [--out plan.yaml]
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from pdserve.loadgen.metrics import SLO
from pdserve.loadgen.workloads import WorkloadSpec
from pdserve.planner.cluster_spec import PoolSpec
from pdserve.planner.explain import report
from pdserve.planner.model_shape import get_model
from pdserve.planner.search import SearchConfig, search
from pdserve.planner.workload import sample_lengths


@dataclass
class PlanResult:
    ranked: list = field(default_factory=list)
    phase: dict = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)
    config: dict | None = None


def cost_model(model_name: str | None, dtype, hardware: str | None, profile: str | None):
    """(model shape, cost model, devices are GPUs); a profile names its model and dtype."""
    if profile:
        from pdserve.planner.fitted import FittedCost

        cost = FittedCost.load(profile)
        model = get_model(model_name or cost.meta["model"], dtype or cost.meta["dtype"])
        return model, cost, False
    from pdserve.planner.hardware import get_hardware, this_cpu
    from pdserve.planner.roofline import RooflineCost

    if not model_name:
        raise ValueError("--model: give a preset or HF folder (or a --profile)")
    model = get_model(model_name, dtype)
    if hardware == "cpu":  # this machine's cores, one thread each, measured now
        return model, RooflineCost(model, this_cpu(threads=1)), False
    return model, RooflineCost(model, get_hardware(hardware or "a100")), True


def plan(
    model_name: str | None,
    cfg: SearchConfig,
    spec: WorkloadSpec,
    *,
    hardware: str | None = None,
    profile: str | None = None,
    dtype: str | None = None,
    samples: int = 300,
    serve_model: str | None = None,
    log=lambda line: None,
) -> PlanResult:
    model, cost, gpu = cost_model(model_name, dtype, hardware, profile)
    lengths = sample_lengths(spec, samples, model.max_position)
    log(
        f"plan: {model.name} on {cfg.devices} devices, {spec.name} "
        f"({len(lengths)} sampled requests), SLO TTFT {cfg.slo.ttft_ms:g} ms / TPOT "
        f"{cfg.slo.tpot_ms:g} ms at {cfg.slo.attainment:.0%}"
    )
    ranked, phase = search(cost, model, lengths, cfg, log)
    out = PlanResult(ranked, phase, report(ranked, phase, cfg.slo))
    if ranked:
        win = ranked[0].cluster
        blocks = {
            p.tp: cost.kv_capacity_tokens(p.tp) // p.block_size
            for p in (win.prefill, win.decode, win.colocated)
        }
        win = _with_blocks(win, blocks)
        slo = {
            "ttft_ms": cfg.slo.ttft_ms,
            "tpot_ms": cfg.slo.tpot_ms,
            "attainment": cfg.slo.attainment,
        }
        dtype_name = {2: "bfloat16", 4: "float32"}[model.dtype_bytes]
        name = serve_model or model_name or cost.meta["model"]
        out.config = win.to_config(name, gpu=gpu, dtype=dtype_name, slo=slo)
        if gpu:
            out.config["ray"] = {"address": "auto"}  # a GPU cluster to join
    return out


def _with_blocks(cluster, blocks: dict):
    from dataclasses import replace

    def fill(p: PoolSpec) -> PoolSpec:
        return p if p.kv_blocks else replace(p, kv_blocks=max(1, blocks[p.tp]))

    return replace(
        cluster,
        prefill=fill(cluster.prefill),
        decode=fill(cluster.decode),
        colocated=fill(cluster.colocated),
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", help="preset (opt-13b, llama-3-8b, ...) or HF folder; default: the profile's"
    )
    p.add_argument("--devices", type=int, required=True, help="devices (GPUs or CPUs) to use")
    p.add_argument(
        "--workload", default="sharegpt", choices=["sharegpt", "humaneval", "longprompt"]
    )
    p.add_argument("--long-prompt-mean", type=int, default=1500)
    p.add_argument("--long-output-mean", type=int, default=90)
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=150.0)
    p.add_argument("--attainment", type=float, default=0.9)
    hw = p.add_mutually_exclusive_group()
    hw.add_argument("--hardware", help="roofline of a100, h100, h200 (default) or cpu (measured)")
    hw.add_argument("--profile", help="a profile.json of this machine (pdserve profile)")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--tp-degrees", default="1,2,4,8", help="tensor-parallel degrees to try")
    p.add_argument("--max-batch-size", type=int, default=64)
    p.add_argument("--max-batch-tokens", type=int, default=512)
    p.add_argument("--samples", type=int, default=300, help="requests sampled from the workload")
    p.add_argument("--duration", type=float, default=60.0, help="simulated seconds per rate")
    p.add_argument("--verify", type=int, default=3, help="candidates per mode simulated whole")
    p.add_argument("--modes", default="disaggregated,colocated")
    p.add_argument("--serve-model", help="the config's model key (default: --model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="plan.yaml", help="the config written")


def main(args: argparse.Namespace) -> int:
    started = time.monotonic()
    cfg = SearchConfig(
        devices=args.devices,
        slo=SLO(args.slo_ttft_ms, args.slo_tpot_ms, args.attainment),
        tp_degrees=tuple(int(t) for t in args.tp_degrees.split(",")),
        pool=PoolSpec(max_batch_tokens=args.max_batch_tokens, max_batch_size=args.max_batch_size),
        modes=tuple(args.modes.split(",")),
        verify=args.verify,
        duration_s=args.duration,
        seed=args.seed,
    )
    spec = WorkloadSpec(
        args.workload,
        seed=args.seed,
        long_prompt_mean=args.long_prompt_mean,
        long_output_mean=args.long_output_mean,
        dataset_limit=3000,
    )
    try:
        result = plan(
            args.model,
            cfg,
            spec,
            hardware=args.hardware,
            profile=args.profile,
            dtype=args.dtype,
            samples=args.samples,
            serve_model=args.serve_model,
            log=lambda line: print(line, flush=True),
        )
    except (ValueError, OSError) as e:
        print(f"pdserve plan: {e}", file=sys.stderr)
        return 2
    print("\n".join(result.lines))
    if result.config is None:
        return 1
    Path(args.out).write_text(yaml.safe_dump(result.config, sort_keys=False))
    print(f"plan: wrote {args.out} in {time.monotonic() - started:.1f} s")
    return 0
