"""Latency records, SLO attainment, and the goodput search.

Goodput (DistServe, OSDI'24): the highest request rate at which at least ``attainment``
(default 90%) of the requests meet both the TTFT and the TPOT objective. A failed
request (an RPC error, an abort) meets neither. ``search_goodput`` finds it from a
function rate -> records: the rates given first, then doubling or halving until one
rate passes and a higher one fails, then bisection between them. Because measured
attainment is noisy, the goodput is the highest passing rate below the lowest failing
one, so that a lucky pass above a failure does not count.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field

PERCENTILES = (50, 90, 99)


@dataclass
class SLO:
    ttft_ms: float = 1000.0
    tpot_ms: float = 150.0
    attainment: float = 0.9  # share of requests that must meet both

    def scaled(self, factor: float) -> SLO:
        """Both objectives times ``factor`` (DistServe's "SLO scale"), the same target."""
        return SLO(self.ttft_ms * factor, self.tpot_ms * factor, self.attainment)


@dataclass
class Record:
    """One request as the client saw it; times from the router's final message."""

    index: int
    sent_s: float  # when it was sent, seconds after the start of the run
    prompt_tokens: int
    output_len: int  # asked for (max_tokens, with ignore_eos)
    completion_tokens: int = 0
    ttft_ms: float = math.inf
    tpot_ms: float = math.inf
    e2e_ms: float = math.inf
    queue_ms: float = 0.0
    finish_reason: str | None = None
    error: str | None = None  # grpc status code name and details
    instances: list[str] = field(default_factory=list)
    kv_bytes: int = 0
    kv_cached_tokens: int = 0  # disaggregated: prompt tokens whose KV decode held (not sent)
    cached_tokens: int = 0  # prompt tokens whose KV was not computed for it (a cache hit)
    transfer_ms: float = 0.0
    phases: dict = field(default_factory=dict)  # ms since arrival (per-token times dropped)
    lag_ms: float = 0.0  # sent after its scheduled arrival (the client fell behind)

    @property
    def ok(self) -> bool:
        return self.error is None and self.finish_reason in ("stop", "length")

    def meets_ttft(self, slo: SLO) -> bool:
        return self.ok and self.ttft_ms <= slo.ttft_ms

    def meets_tpot(self, slo: SLO) -> bool:
        # one output token has no TPOT (the router reports 0)
        return self.ok and self.tpot_ms <= slo.tpot_ms

    def to_dict(self) -> dict:
        d = asdict(self)
        for key in ("ttft_ms", "tpot_ms", "e2e_ms"):
            d[key] = None if math.isinf(d[key]) else d[key]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Record:
        """The inverse of ``to_dict`` (a record read back from results.json)."""
        d = dict(d)
        for key in ("ttft_ms", "tpot_ms", "e2e_ms"):
            d[key] = math.inf if d.get(key) is None else d[key]
        return cls(**d)


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default); None for no values."""
    if not values:
        return None
    v = sorted(values)
    pos = (len(v) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def attainment(records: list[Record], slo: SLO) -> float:
    """Share of the requests that meet both objectives (0 for none)."""
    if not records:
        return 0.0
    return sum(r.meets_ttft(slo) and r.meets_tpot(slo) for r in records) / len(records)


def summarize(records: list[Record], slo: SLO) -> dict:
    """Attainment, throughput and latency percentiles of one run (one rate)."""
    n, ok = len(records), [r for r in records if r.ok]
    start = min((r.sent_s for r in records), default=0.0)
    end = max((r.sent_s + r.e2e_ms / 1000 for r in ok), default=start)
    span = end - start
    out_tokens = sum(r.completion_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    summary = {
        "requests": n,
        "completed": len(ok),
        "errors": n - len(ok),
        "attainment": attainment(records, slo),
        "attainment_ttft": sum(r.meets_ttft(slo) for r in records) / n if n else 0.0,
        "attainment_tpot": sum(r.meets_tpot(slo) for r in records) / n if n else 0.0,
        "duration_s": span,
        "request_throughput": len(ok) / span if span > 0 else 0.0,
        "output_token_throughput": out_tokens / span if span > 0 else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / span if span > 0 else 0.0,
        "max_lag_ms": max((r.lag_ms for r in records), default=0.0),
        # prefix reuse: the share of prompt tokens served from a cache (not computed), the
        # share whose KV the decode instance held (not sent), KV moved per request
        "hit_rate": sum(r.cached_tokens for r in ok) / in_tokens if in_tokens else 0.0,
        "kv_hit_rate": sum(r.kv_cached_tokens for r in ok) / in_tokens if in_tokens else 0.0,
        "mean_kv_bytes": sum(r.kv_bytes for r in ok) / len(ok) if ok else 0.0,
    }
    for metric in ("ttft_ms", "tpot_ms", "e2e_ms"):
        values = [getattr(r, metric) for r in ok]
        name = metric[: -len("_ms")]
        summary[f"mean_{name}_ms"] = sum(values) / len(values) if values else None
        for q in PERCENTILES:
            summary[f"p{q}_{name}_ms"] = percentile(values, q)
    return summary


@dataclass
class GoodputResult:
    goodput: float  # requests per second; 0 when no rate met the target
    met: bool  # some measured rate met the target
    attainment: dict[float, float]  # every rate measured -> its attainment
    lowest_failing: float | None  # the rate above which goodput was not found


def goodput_from(measured: dict[float, float], target: float) -> GoodputResult:
    """The highest passing rate below the lowest failing one among measured rates."""
    failing = [r for r, a in measured.items() if a < target]
    lowest_failing = min(failing, default=None)
    passing = [
        r
        for r, a in measured.items()
        if a >= target and (lowest_failing is None or r < lowest_failing)
    ]
    best = max(passing, default=0.0)
    return GoodputResult(best, bool(passing), dict(sorted(measured.items())), lowest_failing)


def search_goodput(
    run: Callable[[float], list[Record]],
    slo: SLO,
    rates: Iterable[float] = (1.0,),
    *,
    search: bool = True,
    rel_tol: float = 0.1,
    max_runs: int = 12,
    min_rate: float = 1e-3,
    max_rate: float = 1e4,
    on_rate: Callable[[float, list[Record]], None] | None = None,
) -> GoodputResult:
    """Goodput from ``run(rate) -> records``: measure ``rates``; with ``search``, also
    bracket the goodput (double above the highest pass, halve below the lowest fail)
    and bisect until the bracket is within ``rel_tol`` or ``max_runs`` runs are spent.
    ``on_rate(rate, records)`` sees every run."""
    measured: dict[float, float] = {}

    def measure(rate: float) -> None:
        records = run(rate)
        measured[rate] = attainment(records, slo)
        if on_rate is not None:
            on_rate(rate, records)

    for rate in sorted(set(rates)):
        measure(rate)
    if not search:
        return goodput_from(measured, slo.attainment)
    while len(measured) < max_runs:
        result = goodput_from(measured, slo.attainment)
        lo, hi = (result.goodput if result.met else None), result.lowest_failing
        if lo is None:  # nothing passes: go lower
            rate = hi / 2
            if rate < min_rate:
                break
        elif hi is None:  # everything passes: go higher
            rate = lo * 2
            if rate > max_rate:
                break
        else:
            if hi / lo - 1 <= rel_tol:
                break
            rate = math.sqrt(lo * hi)  # bisect in log space: rates span decades
        if rate in measured:
            break
        measure(rate)
    return goodput_from(measured, slo.attainment)
