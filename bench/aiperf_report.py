"""The rows ``bench.aiperf_check`` compares and their tables: AIPerf against
``pdserve bench`` on the same requests, and the server's histograms against AIPerf's
client figures over the same run.

A row is a dict: ``what`` (its label), the figures compared (ms, None when a side has
none) and ``ok``. Agreement rows: ``bench``, ``aiperf``, ``ratio`` (aiperf / bench),
``ok`` when the ratio is within the tolerance. Histogram rows: ``aiperf`` (the
client figure), ``server`` (the histogram's quantile, interpolated here),
``aiperf_estimate`` (AIPerf's own estimate from its scrapes), ``width`` (of the
widest bucket among those the client figure and the estimates fall in), ``ok`` when
every server figure present is within that width of the client figure; the ``TTFT
count`` row is ``ok`` when the histogram counted exactly AIPerf's requests (the
window holds its run and nothing else).

Why the widest: an interpolated quantile is only known to lie in the bucket its rank
falls in, and the client's percentile (linear between two requests, measured at the
client) can sit just across that bucket's edge, e.g. a client p99 of 0.98 s whose
slowest request, at 1.01 s, puts the server's p99 rank in (1.0, 2.5].
"""

from __future__ import annotations

import math
import statistics

from pdserve.bench.aiperf_run import PERCENTILES, AiperfResult
from pdserve.bench.prom_histograms import bucket_width, quantile
from pdserve.loadgen.metrics import Record

# (row label, server histogram, AIPerf's client metric)
HISTOGRAM_ROWS = (
    ("TTFT", "pdserve:time_to_first_token_seconds", "time_to_first_token"),
    ("ITL", "pdserve:request_time_per_output_token_seconds", "inter_token_latency"),
    ("token gap", "pdserve:inter_token_latency_seconds", "inter_chunk_latency"),
)


def agreement_rows(bench: dict, pooled: dict, tolerance: float) -> list[dict]:
    """AIPerf (``pooled``: tag -> q -> ms) against ``pdserve bench`` (``bench``:
    ``summarize``'s dict), the same requests."""
    rows = []
    for label, key, tag in (
        ("TTFT", "ttft", "time_to_first_token"),
        ("ITL", "tpot", "inter_token_latency"),
    ):
        for q in PERCENTILES:
            ref, got = bench[f"p{q}_{key}_ms"], pooled.get(tag, {}).get(q)
            ratio = got / ref if ref and got is not None else None
            ok = ratio is not None and abs(ratio - 1) <= tolerance
            rows.append(
                {"what": f"{label} p{q} ms", "bench": ref, "aiperf": got, "ratio": ratio, "ok": ok}
            )
    return rows


def paired_ratios(bench: dict[int, Record], aiperf: dict[int, dict]) -> dict[str, float | None]:
    """The same request seen by both clients: the median over requests of AIPerf's
    figure / bench's, for TTFT and ITL (bench's TPOT). ``bench``: request index ->
    bench's record; ``aiperf``: request index -> AIPerf's values
    (``AiperfResult.per_request``). Robust to the few slow requests that move a p99: a
    ratio far from 1 here is a difference in what is measured, not in when."""
    ratios: dict[str, list[float]] = {"TTFT": [], "ITL": []}
    for k, rec in bench.items():
        got = aiperf.get(k)
        if got is None or not rec.ok:
            continue
        for label, ref, tag in (
            ("TTFT", rec.ttft_ms, "time_to_first_token"),
            ("ITL", rec.tpot_ms, "inter_token_latency"),
        ):
            if ref and got[tag] is not None:
                ratios[label].append(got[tag] / ref)
    return {k: statistics.median(v) if v else None for k, v in ratios.items()}


def histogram_rows(window: dict, ai: AiperfResult) -> list[dict]:
    """The server's histograms over one AIPerf run (``window``: name -> Histogram)
    against that run's client figures; none when the server has no such histograms."""
    rows = []
    for label, name, tag in HISTOGRAM_ROWS:
        h = window.get(name)
        if h is None:
            continue
        if label == "TTFT":
            rows.append(
                {
                    "what": "TTFT count",
                    "aiperf": ai.requests,
                    "server": h.count,
                    "aiperf_estimate": None,
                    "width": 0.0,
                    "ok": h.count == ai.requests,
                }
            )
        for q in PERCENTILES:
            client = ai.client.get(tag, {}).get(q)
            ours = quantile(h, q / 100)
            theirs = ai.server.get(name, {}).get(q)
            near = [v * 1e3 for v in (ours, theirs) if v is not None]
            if client is None or not near:
                width, ok = math.inf, False
            else:
                width = max(bucket_width(h, v / 1e3) * 1e3 for v in (client, *near))
                ok = all(abs(v - client) <= width for v in near)
            rows.append(
                {
                    "what": f"{label} p{q} ms",
                    "aiperf": client,
                    "server": None if ours is None else ours * 1e3,
                    "aiperf_estimate": None if theirs is None else theirs * 1e3,
                    "width": width,
                    "ok": ok,
                }
            )
    return rows


def fmt(v) -> str:
    if v is None:
        return "-"
    if float(v).is_integer() or abs(v) >= 10:
        return f"{v:.0f}"
    return f"{v:.3g}"


def table(header: list[str], lines: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *lines]) for i in range(len(header))]
    return "\n".join(
        "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in [header, *lines]
    )


VERDICT = {True: "pass", False: "FAIL"}


def agreement_table(rows: list[dict], tolerance: float) -> str:
    return table(
        ["", "pdserve bench", "aiperf", "ratio", f"within {tolerance:.0%}"],
        [
            [
                r["what"],
                fmt(r["bench"]),
                fmt(r["aiperf"]),
                "-" if r["ratio"] is None else f"{r['ratio']:.2f}",
                VERDICT[r["ok"]],
            ]
            for r in rows
        ],
    )


def histogram_table(rows: list[dict]) -> str:
    return table(
        ["", "aiperf (client)", "/metrics", "aiperf's estimate", "bucket", "within a bucket"],
        [
            [
                r["what"],
                fmt(r["aiperf"]),
                fmt(r["server"]),
                fmt(r["aiperf_estimate"]),
                fmt(r["width"]),
                VERDICT[r["ok"]],
            ]
            for r in rows
        ],
    )
