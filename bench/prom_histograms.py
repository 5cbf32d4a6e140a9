"""Histograms read from a server's Prometheus ``/metrics`` page: the difference
between two scrapes (what a run added) and its quantiles interpolated within the
buckets, as Prometheus's ``histogram_quantile`` computes them.

    before = histograms(scrape(url))
    ...  # the load
    ttft = delta(histograms(scrape(url)), before)["pdserve:time_to_first_token_seconds"]
    quantile(ttft, 0.99), bucket_width(ttft, 0.42)

A ``Histogram`` is one metric family summed over its label sets (every model, every
KV pair). Invariants: ``bounds`` ascend and end with ``inf``; ``cumulative`` has one
count per bound, never decreasing, its last equal to ``count``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Histogram:
    bounds: tuple[float, ...]  # each bucket's upper bound (``le``), the last inf
    cumulative: tuple[float, ...]  # observations <= each bound
    total: float  # the sum of the observations

    @property
    def count(self) -> float:
        return self.cumulative[-1] if self.cumulative else 0.0


def scrape(url: str, timeout_s: float = 10.0) -> str:
    """The text of ``GET url`` (a ``/metrics`` page); httpx's error when it fails."""
    import httpx

    r = httpx.get(url, timeout=timeout_s)
    r.raise_for_status()
    return r.text


def histograms(text: str) -> dict[str, Histogram]:
    """Every histogram family of a Prometheus exposition (prometheus_client's parser),
    by family name, its series summed bucket by bucket."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, Histogram] = {}
    for family in text_string_to_metric_families(text):
        if family.type != "histogram":
            continue
        buckets: dict[float, float] = {}
        total = 0.0
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                le = float(sample.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + sample.value
            elif sample.name.endswith("_sum"):
                total += sample.value
        bounds = tuple(sorted(buckets))
        if bounds and math.isinf(bounds[-1]):
            out[family.name] = Histogram(bounds, tuple(buckets[b] for b in bounds), total)
    return out


def delta(after: dict[str, Histogram], before: dict[str, Histogram]) -> dict[str, Histogram]:
    """What was observed between two scrapes: ``after`` minus ``before``, bucket by
    bucket (a family absent before counts from zero). ValueError when a family's
    buckets changed or a count went down (the server restarted between them)."""
    out = {}
    for name, h in after.items():
        old = before.get(name)
        if old is None:
            out[name] = h
            continue
        if old.bounds != h.bounds:
            raise ValueError(
                f"{name}: buckets changed between scrapes ({old.bounds} -> {h.bounds})"
            )
        cumulative = tuple(a - b for a, b in zip(h.cumulative, old.cumulative, strict=True))
        if min(cumulative, default=0.0) < 0:
            raise ValueError(f"{name}: a count went down between scrapes (a restart?)")
        out[name] = Histogram(h.bounds, cumulative, h.total - old.total)
    return out


def quantile(h: Histogram, q: float) -> float | None:
    """The ``q`` quantile (0..1), linear within the bucket it falls in (the first
    bucket starts at 0); past the last finite bound, that bound. None when empty."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q={q}: a quantile is within 0..1")
    if h.count <= 0:
        return None
    rank = q * h.count
    lower, below = 0.0, 0.0
    for bound, cumulative in zip(h.bounds, h.cumulative, strict=True):
        if cumulative >= rank and cumulative > below:
            if math.isinf(bound):
                return lower
            return lower + (bound - lower) * (rank - below) / (cumulative - below)
        lower, below = bound, cumulative
    return lower


def bucket_width(h: Histogram, value: float) -> float:
    """The width of the bucket ``value`` falls in (``lower < value <= upper``); inf in
    the last, unbounded one."""
    lower = 0.0
    for bound in h.bounds:
        if value <= bound:
            return bound - lower
        lower = bound
    return math.inf
