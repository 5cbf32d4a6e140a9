"""The placement search (DistServe §4.1, Algorithm 1, for one node of ``devices``):

1. per phase and tensor-parallel degree, the goodput of one instance alone (the other
   phase free): a prefill instance against the TTFT objective, a decode instance
   against TPOT, a co-located instance against both;
2. every split of the devices into prefill and decode instances (and every co-located
   replication) gets the estimate min(prefill instances x its goodput, decode instances
   x its goodput);
3. the best ``verify`` estimates of each mode are simulated whole (router queue,
   both pools, the transfer) and ranked by goodput, then per-device goodput.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from pdserve.loadgen.metrics import SLO, GoodputResult, search_goodput
from pdserve.planner.cluster_spec import ClusterSpec, PoolSpec
from pdserve.planner.simulator import simulate
from pdserve.planner.workload import with_arrivals


@dataclass
class SearchConfig:
    devices: int
    slo: SLO = field(default_factory=SLO)
    tp_degrees: tuple[int, ...] = (1, 2, 4, 8)
    pool: PoolSpec = field(default_factory=PoolSpec)  # batch limits of every instance
    modes: tuple[str, ...] = ("disaggregated", "colocated")
    verify: int = 3  # candidates per mode simulated whole
    max_runs: int = 10  # simulated rates per goodput search
    duration_s: float = 60.0  # simulated seconds of arrivals per rate (rate x duration requests)
    min_requests: int = 100
    max_requests: int = 3000
    rel_tol: float = 0.05
    burstiness: float = 1.0
    seed: int = 0
    layerwise: bool = True


@dataclass
class Candidate:
    cluster: ClusterSpec
    estimate: float  # req/s, from the per-phase goodputs
    goodput: GoodputResult | None = None
    runs: dict = field(default_factory=dict)  # rate -> records

    @property
    def value(self) -> float:
        return self.goodput.goodput if self.goodput else 0.0

    @property
    def per_device(self) -> float:
        return self.value / self.cluster.devices


class PhaseOnly:
    """A cost model where the other phase is free: what one pool sustains alone."""

    def __init__(self, cost, phase: str):
        self.cost, self.phase = cost, phase
        self.kv_bytes_per_token = cost.kv_bytes_per_token

    def prefill_s(self, tokens, sum_sq, tp=1):
        return self.cost.prefill_s(tokens, sum_sq, tp) if self.phase == "prefill" else 0.0

    def decode_s(self, batch, context, tp=1):
        return self.cost.decode_s(batch, context, tp) if self.phase == "decode" else 0.0

    def mixed_s(self, tokens, sum_sq, batch, context, tp=1):
        return self.prefill_s(tokens, sum_sq, tp) + self.decode_s(batch, context, tp)

    def transfer_s(self, nbytes):
        return self.cost.transfer_s(nbytes) if self.phase == "prefill" else 0.0

    def transfer_bytes(self, tokens, decode_tp):
        return self.cost.transfer_bytes(tokens, decode_tp)

    def kv_capacity_tokens(self, tp):
        return self.cost.kv_capacity_tokens(tp)


def goodput(cluster, cost, lengths, cfg: SearchConfig, slo: SLO, guess: float):
    """The simulated goodput of ``cluster`` and the records of every rate tried."""
    runs: dict[float, list] = {}

    def run(rate: float):
        n = min(cfg.max_requests, max(cfg.min_requests, round(rate * cfg.duration_s)))
        cycled = [lengths[i % len(lengths)] for i in range(n)]
        reqs = with_arrivals(cycled, rate, cfg.burstiness, cfg.seed)
        runs[rate] = simulate(cluster, cost, reqs)
        return runs[rate]

    result = search_goodput(
        run, slo, [guess], rel_tol=cfg.rel_tol, max_runs=cfg.max_runs, min_rate=1e-3
    )
    return result, runs


def service_guess(cost, lengths, tp: int) -> float:
    """A starting rate: prompts per second one instance prefills in 512-token steps."""
    tokens = sum(p for p, _ in lengths) / len(lengths)
    step = cost.prefill_s(512, 512 * tokens, tp)
    return max(1e-3, 512 / tokens / step) if step > 0 else 1.0


def phase_goodputs(cost, lengths, cfg: SearchConfig, tps: list[int]) -> dict:
    """(phase, tp) -> goodput of one instance of that phase alone, req/s."""
    out = {}
    for tp in tps:
        if cost.kv_capacity_tokens(tp) <= 0:
            continue  # the weights do not fit
        one = replace(cfg.pool, tp=tp)
        guess = service_guess(cost, lengths, tp)
        for phase in ("prefill", "decode"):
            # the other pool: free and unbounded; queueing for decode slots still counts
            big = replace(cfg.pool, tp=tp, max_batch_size=1 << 20, kv_blocks=1 << 30)
            pools = (one, big) if phase == "prefill" else (big, one)
            cluster = ClusterSpec("disaggregated", *pools, layerwise=cfg.layerwise)
            result, _ = goodput(cluster, PhaseOnly(cost, phase), lengths, cfg, cfg.slo, guess)
            out[phase, tp] = result.goodput
        if "colocated" in cfg.modes:
            cluster = ClusterSpec("colocated", colocated=one)
            out["colocated", tp] = goodput(cluster, cost, lengths, cfg, cfg.slo, guess)[0].goodput
    return out


def candidates(phase: dict, cfg: SearchConfig, tps: list[int]) -> list[Candidate]:
    n = cfg.devices
    out = []
    if "disaggregated" in cfg.modes or "hybrid" in cfg.modes:
        for tp_p in tps:
            for tp_d in tps:
                if ("prefill", tp_p) not in phase or ("decode", tp_d) not in phase:
                    continue
                for n_p in range(1, n // tp_p + 1):
                    n_d = (n - n_p * tp_p) // tp_d
                    if n_d < 1:
                        continue
                    est = min(n_p * phase["prefill", tp_p], n_d * phase["decode", tp_d])
                    pools = (
                        replace(cfg.pool, instances=n_p, tp=tp_p),
                        replace(cfg.pool, instances=n_d, tp=tp_d),
                    )
                    for mode in [m for m in ("disaggregated", "hybrid") if m in cfg.modes]:
                        # hybrid: the same pools; the estimate is the disaggregated one's
                        cluster = ClusterSpec(
                            mode, *pools, layerwise=cfg.layerwise, tpot_ms=cfg.slo.tpot_ms
                        )
                        out.append(Candidate(cluster, est))
    if "colocated" in cfg.modes:
        for tp in tps:
            if ("colocated", tp) in phase and n // tp >= 1:
                pool = replace(cfg.pool, instances=n // tp, tp=tp)
                est = n // tp * phase["colocated", tp]
                out.append(Candidate(ClusterSpec("colocated", colocated=pool), est))
    return out


def search(cost, model, lengths, cfg: SearchConfig, log=lambda line: None):
    """(candidates simulated whole, best first; the per-phase goodputs)."""
    tps = [t for t in cfg.tp_degrees if t in model.tp_degrees(cfg.devices)]
    phase = phase_goodputs(cost, lengths, cfg, tps)
    for (name, tp), g in sorted(phase.items()):
        log(f"  one {name} instance, tp {tp}: {g:.3g} req/s")
    all_ = candidates(phase, cfg, tps)
    chosen = []
    for mode in cfg.modes:
        mine = [c for c in all_ if c.cluster.mode == mode]
        mine.sort(key=lambda c: (-c.estimate, c.cluster.devices))
        chosen += mine[: cfg.verify]
    for c in chosen:
        guess = max(c.estimate, 1e-3)
        c.goodput, c.runs = goodput(c.cluster, cost, lengths, cfg, cfg.slo, guess)
        log(f"  {c.cluster.describe()}: estimate {c.estimate:.3g}, simulated {c.value:.3g} req/s")
    chosen.sort(key=lambda c: (-c.value, -c.per_device, c.cluster.devices))
    return chosen, phase
