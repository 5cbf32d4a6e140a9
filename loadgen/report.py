"""The comparison's side-by-side table (for the terminal and HTML) and report.html,
self-contained: the plots are embedded as base64 data URIs."""

from __future__ import annotations

import base64
import html
from pathlib import Path

from pdserve.loadgen.plots import (
    attainment_vs_rate,
    attainment_vs_slo_scale,
    tpot_cdf,
    ttft_vs_prompt,
    ttft_vs_rate,
)

PLOTS = {
    "attainment-vs-rate.png": attainment_vs_rate,
    "ttft-vs-rate.png": ttft_vs_rate,
    "attainment-vs-slo-scale.png": attainment_vs_slo_scale,
    "tpot-cdf.png": tpot_cdf,
    "ttft-vs-prompt.png": ttft_vs_prompt,
}


def fmt_ms(values) -> str:
    def one(v):
        return "-" if v is None else f"{v:.0f}" if v >= 10 else f"{v:.1f}"

    return "/".join(one(v) for v in values)


def fmt_goodput(goodput: dict, key: str = "goodput") -> str:
    return f"{goodput[key]:.3g}" if goodput["met"] else "0 (none met)"


ROW_LABELS = (
    "attainment",
    "TTFT p50/p90/p99 ms",
    "TPOT p50/p90/p99 ms",
    "hit rate",
    "KV held at decode",
    "KV MB per request",
)


def rows_at(summary: dict | None) -> list[str]:
    """One rate's cells, as ``ROW_LABELS`` ("-": not measured): attainment, TTFT and
    TPOT p50/p90/p99, the prefix-cache hit rate (computed: cached / prompt tokens), the
    share of prompt tokens whose KV the decode instance held (so the handoff did not send
    it), the KV bytes moved per request (disaggregated handoffs)."""
    if summary is None:
        return ["-"] * len(ROW_LABELS)
    return [
        f"{summary['attainment']:.2f}",
        fmt_ms(summary[f"p{q}_ttft_ms"] for q in (50, 90, 99)),
        fmt_ms(summary[f"p{q}_tpot_ms"] for q in (50, 90, 99)),
        f"{summary.get('hit_rate', 0.0):.2f}",
        f"{summary.get('kv_hit_rate', 0.0):.2f}",
        f"{summary.get('mean_kv_bytes', 0.0) / 1e6:.3g}",
    ]


def summary_at(contender: dict, rate: float) -> dict | None:
    return next((r["summary"] for r in contender["runs"] if r["rate"] == rate), None)


def table(results: dict) -> tuple[list[str], list[list[str]]]:
    """(header, rows): a column per contender, a row per figure."""
    contenders = results["contenders"]
    header = ["", *(c["name"] for c in contenders)]
    rows = [
        ["devices", *(str(c["devices"]) for c in contenders)],
        ["goodput (req/s)", *(fmt_goodput(c["goodput"]) for c in contenders)],
        ["goodput per device", *(fmt_goodput(c["goodput"], "per_device") for c in contenders)],
    ]
    rates = sorted({run["rate"] for c in contenders for run in c["runs"]})
    for rate in rates:
        cells = [rows_at(summary_at(c, rate)) for c in contenders]
        for i, label in enumerate(ROW_LABELS):
            rows.append([f"{label} @ {rate:g}/s", *(col[i] for col in cells)])
    return header, rows


def devices_note(results: dict) -> str:
    if results["same_devices"]:
        n = next(iter(results["devices"].values()))
        return f"Every contender uses {n} devices."
    each = ", ".join(f"{name}: {n}" for name, n in results["devices"].items())
    return (
        f"The contenders use different numbers of devices ({each}): compare the per-device "
        "goodput; the attainment plot is per device."
    )


def text_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)) for r in rows]
    head = "  ".join(cell.ljust(w) for cell, w in zip(header, widths, strict=True))
    return "\n".join([head.rstrip(), *(line.rstrip() for line in lines)])


def html_report(results: dict, pngs: dict[str, bytes]) -> str:
    header, rows = table(results)
    e = html.escape
    head = "".join(f"<th>{e(c)}</th>" for c in header)
    body = "".join(
        "<tr>" + f"<th>{e(r[0])}</th>" + "".join(f"<td>{e(c)}</td>" for c in r[1:]) + "</tr>"
        for r in rows
    )
    w, slo = results["workload"], results["slo"]
    images = "".join(
        f'<figure><img alt="{e(name)}" src="data:image/png;base64,'
        f'{base64.b64encode(data).decode()}"><figcaption>{e(name)}</figcaption></figure>'
        for name, data in pngs.items()
    )
    return f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>pdserve compare</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}
th,td{{border:1px solid #ccc;padding:4px 8px;text-align:right}}
figure{{display:inline-block;margin:1em}}</style></head>
<body><h1>pdserve compare</h1>
<p>Workload {e(w["name"])} (seed {w["seed"]}), {results["duration_s"]:g} s of arrivals per
rate; goodput: the highest rate at which {slo["attainment"]:.0%} of requests meet TTFT
{slo["ttft_ms"]:g} ms and TPOT {slo["tpot_ms"]:g} ms. {e(devices_note(results))}</p>
{f"<p>Replay of {e(replay_line(results))}</p>" if replay_line(results) else ""}
<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>
{images}
</body></html>
"""


def replay_line(results: dict) -> str | None:
    """The window and scales of a trace replay (workloads azure, mooncake), else None."""
    replay = results.get("trace_replay")
    return replay["summary"] if replay else None


def write_report(results: dict, out_dir: str | Path) -> str:
    """Write the plots and report.html into ``out_dir``; return the table as text."""
    out_dir = Path(out_dir)
    pngs = {name: plot(results) for name, plot in PLOTS.items()}
    for name, data in pngs.items():
        (out_dir / name).write_bytes(data)
    (out_dir / "report.html").write_text(html_report(results, pngs))
    text = text_table(*table(results)) + "\n" + devices_note(results)
    return text + (f"\nReplay of {replay_line(results)}" if replay_line(results) else "")
