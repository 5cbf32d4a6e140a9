"""``pdserve profile --served CONFIG...``: a cost model fitted to the steps a cluster
serves under load, instead of the engine timed alone.

The offline profile (``planner.profile``) times ``engine.step()`` on a quiet
machine. Served, a step also pays the instance's loop (calls applied, its updates
published, the role's own work between steps: layer-wise KV sends, landings), and its
CPU share is taken by the other instances, the router, Ray and the load generator. Here
each config's cluster is launched, a calibration workload is replayed through the
router (open loop, ``loadgen.replay``), and every instance's step log
(``EngineWorker.step_log``: the step's shape and the loop time it took) is fitted:

- prefill instances' steps: ``prefill = a + b tokens + c sum_sq``;
- decode instances' steps: ``decode = a + b batch + c context``;
- co-located instances' steps, prompt chunks beside decodes:
  ``mixed = a + b tokens + c sum_sq + d batch + e context``. A co-located config alone
  also gives ``prefill`` and ``decode`` (the same fit with the other phase absent).

The KV transfer is measured as the offline profile does (``profile_transfer``).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import defaultdict

from pdserve.loadgen.trace_replay import trace_window
from pdserve.loadgen.workloads import PRODUCTION_TRACES, WorkloadSpec, make_workload, model_info
from pdserve.planner.fitted import FittedCost, fit_linear

# (role, tensor-parallel degree) -> [prefill_tokens, sum_sq, decodes, context, seconds]
Samples = dict[tuple[str, int], list[list[float]]]


def serve_steps(
    config_path: str,
    overrides: list[str],
    spec: WorkloadSpec,
    rate: float,
    duration_s: float,
    log=print,
) -> Samples:
    """Launch the config's cluster, replay the workload at ``rate``, take every
    instance's step log (the warm-up's steps dropped), shut the cluster down."""
    import ray

    from pdserve.cluster.config_loader import load_config
    from pdserve.cluster.launcher import launch
    from pdserve.loadgen.replay import replay

    config = load_config(config_path, overrides)
    tokenizer, max_len = model_info(config.model)
    started = time.monotonic()
    cluster = launch(config)
    log(f"profile: {config_path} up in {time.monotonic() - started:.1f} s")
    client = cluster.client()
    try:
        warm = make_workload(spec, tokenizer, 2, math.inf, max_len)
        asyncio.run(replay(client, warm))
        settle(cluster.workers.values())
        ray.get([w.step_log.remote() for w in cluster.workers.values()])
        reqs = make_workload(spec, tokenizer, max(1, round(rate * duration_s)), rate, max_len)
        records = asyncio.run(replay(client, reqs, f"calibration {rate:g}/s"))
        failed = sum(1 for r in records if not r.ok)
        settle(cluster.workers.values())
        samples: Samples = defaultdict(list)
        pools = config.pools()
        for name, worker in cluster.workers.items():
            role = name.rsplit("-", 1)[0]
            samples[role, pools[role].tensor_parallel] += ray.get(worker.step_log.remote())
    finally:
        client.close()
        cluster.shutdown(drain=False)
    counts = ", ".join(f"{role} tp {tp}: {len(rows)}" for (role, tp), rows in samples.items())
    log(f"profile: {len(records)} requests ({failed} failed); steps {counts}")
    return dict(samples)


def settle(workers) -> None:
    """Wait until every instance's loop has come round once more: a step logs itself just
    after it runs, so a step whose tokens the client already has may not be logged yet
    (a prefill step's request can finish on the decode instance first). The loop runs
    ``check_integrity`` between steps, after the previous step's record."""
    import ray

    ray.get([w.check_integrity.remote() for w in workers])


def _fit(rows: list[list[float]], columns: list[int], what: str) -> list[float]:
    distinct = {tuple(r[c] for c in columns) for r in rows}
    if len(distinct) < len(columns) + 1:
        raise ValueError(
            f"{what}: {len(distinct)} distinct step shapes served, {len(columns) + 1} needed "
            "for the fit; replay more requests (--duration, --rates) or varied lengths"
        )
    return fit_linear([[r[c] for c in columns] for r in rows], [r[4] for r in rows])


def fit_served(samples: Samples) -> tuple[dict, dict, dict]:
    """(prefill, decode, mixed) coefficients per degree from the served steps."""
    prefill, decode, mixed = {}, {}, {}
    for (role, tp), rows in sorted(samples.items()):
        if role == "prefill":
            pure = [r for r in rows if r[2] == 0]
            prefill[tp] = _fit(pure, [0, 1], f"prefill tp {tp}")
        elif role == "decode":
            pure = [r for r in rows if r[0] == 0]
            decode[tp] = _fit(pure, [2, 3], f"decode tp {tp}")
        else:
            mixed[tp] = _fit(rows, [0, 1, 2, 3], f"colocated tp {tp}")
    for tp, (a, b, c, d, e) in mixed.items():
        prefill.setdefault(tp, [a, b, c])
        decode.setdefault(tp, [a, d, e])
    return prefill, decode, mixed


def profile_served(
    configs: list[str],
    overrides: list[str],
    spec: WorkloadSpec,
    rate: float,
    duration_s: float,
    transfer_mib: tuple[float, ...] = (1, 4, 16),
    log=print,
) -> FittedCost:
    """The cost model of the configs' clusters as served (see the module docstring)."""
    from pdserve.cluster.config_loader import load_config
    from pdserve.engine.checkpoint import load_checkpoint
    from pdserve.planner.model_shape import ModelShape
    from pdserve.planner.profile import profile_transfer

    replay = trace_window(spec).to_dict() if spec.name in PRODUCTION_TRACES else None
    if replay:  # the one pace of a trace replay: the rate is not used
        log(f"profile: replay of {replay['summary']}")
    samples: Samples = defaultdict(list)
    capacity: dict[int, int] = {}
    for path in configs:
        config = load_config(path, overrides)
        for key, rows in serve_steps(path, overrides, spec, rate, duration_s, log).items():
            samples[key] += rows
        for pool in config.pools().values():
            tokens = pool.kv_blocks * pool.block_size
            capacity[pool.tensor_parallel] = max(capacity.get(pool.tensor_parallel, 0), tokens)
    prefill, decode, mixed = fit_served(samples)
    for tp in prefill:
        show = ", ".join(
            f"{name} {coef[0] * 1e3:.2f} ms + " + " + ".join(f"{c:.3g}" for c in coef[1:])
            for name, coef in (("prefill", prefill[tp]), ("decode", decode.get(tp)))
            if coef is not None
        )
        if tp in mixed:
            show += f", mixed {mixed[tp][0] * 1e3:.2f} ms + " + " + ".join(
                f"{c:.3g}" for c in mixed[tp][1:]
            )
        log(f"profile: served, tp {tp}: {show}")
    missing = sorted(set(prefill) ^ set(decode))
    if missing:
        raise ValueError(f"tp {missing}: served steps of only one phase; add a config")
    moved = profile_transfer(transfer_mib)
    transfer = fit_linear([[n] for n, _ in moved], [s for _, s in moved])
    gbps = 1e-9 / max(transfer[1], 1e-18)
    log(f"profile: transfer {transfer[0] * 1e3:.2f} ms + bytes at {gbps:.2f} GB/s")
    if replay:
        log(f"profile: fitted on the replay of {replay['summary']}")
    config = load_config(configs[0], overrides)
    shape = ModelShape.from_model_config(
        load_checkpoint(config.model).config, config.model, config.dtype
    )
    meta = {
        "model": config.model,
        "dtype": config.dtype,
        "served": configs,
        "workload": spec.name,
        "trace_replay": replay,
        "rate": rate,
        "duration_s": duration_s,
        "points": {f"{role} tp {tp}": rows for (role, tp), rows in samples.items()},
        "transfer": moved,
    }
    return FittedCost(prefill, decode, transfer, shape.kv_bytes_per_token, capacity, meta, mixed)
