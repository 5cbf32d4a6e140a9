"""What ``bench/peers.py`` prints and writes, from its results dict: the refusal of
impossible figures, the offline and served tables, the ratios pdserve / vLLM, and the
plots (matplotlib, Agg).

Results layout (``results.json``): ``offline``: system -> ``{"info", "rows": {row:
{"best": tok/s | None, "reps", "skipped"}}}``; ``served``: system -> ``{"runs": [{rate,
requests, completed_req_s, output_tok_s, ttft_p50_ms, ttft_p90_ms, itl_p50_ms,
itl_p90_ms, good, goodput_req_s, errors, ...}]}``.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

from pdserve.loadgen.plots import figure, save

VLLM = "vllm"
SATURATED = 0.8
# a figure this far past the ceiling is refused; below it, the peak's own measurement (the
# best of a few, on a shared machine) may have come out a little low
CEILING_MARGIN = 1.05


class Impossible(ValueError):
    """A figure the machine cannot have produced: refused, not printed."""


def matmul_params(folder: Path) -> int:
    """Weights a token multiplies by, from the safetensors headers: all but the
    embedding table (a lookup; a tied LM head counts once more per sampled token, which
    only makes this a lower bound)."""
    total = 0
    for path in sorted(folder.glob("*.safetensors")):
        with open(path, "rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        total += sum(
            math.prod(v["shape"])
            for k, v in header.items()
            if k != "__metadata__" and "embed_tokens" not in k
        )
    return total


def ceiling_tok_s(peak_flops: float, params: int) -> float:
    """Tokens/s no system can pass on this machine: each token costs at least
    2 x params FLOPs, at most ``peak_flops`` a second (``CEILING_MARGIN`` allowed)."""
    return CEILING_MARGIN * peak_flops / (2 * params)


def check_figure(what: str, tokens: int, seconds: float, ceiling: float) -> float:
    """tokens / seconds, or ``Impossible`` when the time is not positive or the rate is
    past the machine's ``ceiling``."""
    if not (seconds > 0 and tokens > 0):
        raise Impossible(f"{what}: {tokens} tokens in {seconds:.4f} s: the time must be positive")
    rate = tokens / seconds
    if rate > ceiling:
        raise Impossible(
            f"{what}: {rate:.0f} tok/s is past this machine's ceiling of {ceiling:.0f} tok/s "
            f"(the measured float32 FMA peak over 2 x params FLOPs per token): "
            "a cache served it or the timing is wrong"
        )
    return rate


def ratio(ours: float | None, theirs: float | None) -> float | None:
    return ours / theirs if ours and theirs else None


def _num(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join([*lines, *("| " + " | ".join(r) + " |" for r in rows)])


def offline_table(offline: dict) -> str:
    """Tokens/s per row and system (best of the repetitions), and pdserve / vLLM."""
    systems = list(offline)
    rows = []
    for row in next(iter(offline.values()))["rows"]:
        cells = [offline[s]["rows"][row]["best"] for s in systems]
        ours, theirs = (
            offline.get(s, {}).get("rows", {}).get(row, {}).get("best") for s in ("pdserve", VLLM)
        )
        rows.append([f"{row} (tok/s)", *map(_num, cells), _x(ratio(ours, theirs))])
    return markdown_table(["row", *systems, "pdserve / vLLM"], rows)


def saturation(runs: list[dict]) -> float | None:
    """Completed requests/s at saturation: the highest completed rate of the sweep."""
    return max((r["completed_req_s"] for r in runs), default=None)


def saturated(runs: list[dict]) -> bool:
    """Whether the sweep reached saturation: at some rate the system completed under
    ``SATURATED`` of what was offered (below saturation AIPerf's span adds the last
    request's service time, so a system keeping up still reads a little under)."""
    return any(r["completed_req_s"] < SATURATED * r["rate"] for r in runs)


def best_pdserve(served: dict) -> str | None:
    """The pdserve configuration with the highest saturation throughput."""
    ours = [name for name in served if name != VLLM]
    return max(ours, key=lambda n: saturation(served[n]["runs"]) or 0.0, default=None)


def run_at(runs: list[dict], rate: float) -> dict | None:
    """The run whose offered rate is closest to ``rate``."""
    return min(runs, key=lambda r: abs(r["rate"] - rate), default=None)


def served_table(served: dict) -> str:
    best = best_pdserve(served)
    rows = []
    for name, system in served.items():
        label = f"{name} (best)" if name == best else name
        for r in system["runs"]:
            good = f"{r['goodput_req_s']:.2f} ({r['good']}/{r['requests']})"
            rows.append(
                [
                    label,
                    f"{r['rate']:g}",
                    _num(r["completed_req_s"], 2),
                    _num(r["output_tok_s"]),
                    _num(r["ttft_p50_ms"], 0),
                    _num(r["ttft_p90_ms"], 0),
                    _num(r["itl_p50_ms"]),
                    _num(r["itl_p90_ms"]),
                    good,
                    str(r["errors"]),
                ]
            )
        sat = _num(saturation(system["runs"]), 2)
        sat += "" if saturated(system["runs"]) else " (not reached)"
        rows.append([label, "saturation", sat, *[""] * 7])
    header = [
        "system",
        "offered req/s",
        "completed req/s",
        "output tok/s",
        "TTFT p50 ms",
        "TTFT p90 ms",
        "ITL p50 ms",
        "ITL p90 ms",
        "goodput req/s (good/sent)",
        "errors",
    ]
    return markdown_table(header, rows)


def ratios(results: dict) -> list[tuple[str, float | None]]:
    """pdserve / vLLM: every offline row, served saturation and the latencies at the
    rate nearest 1 req/s (of the best pdserve configuration)."""
    out = []
    offline = results.get("offline") or {}
    if "pdserve" in offline and VLLM in offline:
        for row, entry in offline["pdserve"]["rows"].items():
            out.append((f"{row} tok/s", ratio(entry["best"], offline[VLLM]["rows"][row]["best"])))
    served = results.get("served") or {}
    best = best_pdserve(served)
    if best and VLLM in served:
        ours, theirs = served[best]["runs"], served[VLLM]["runs"]
        note = "" if saturated(ours) and saturated(theirs) else "; not reached: raise --rates"
        sat = ratio(saturation(ours), saturation(theirs))
        out.append((f"served saturation req/s ({best}{note})", sat))
        a, b = run_at(ours, 1.0), run_at(theirs, 1.0)
        if a and b:
            for key, label in (
                ("ttft_p50_ms", "TTFT p50"),
                ("ttft_p90_ms", "TTFT p90"),
                ("itl_p50_ms", "ITL p50"),
                ("itl_p90_ms", "ITL p90"),
            ):
                out.append(
                    (f"{label} at {a['rate']:g} req/s (lower is better)", ratio(a[key], b[key]))
                )
    return out


def ratio_lines(results: dict) -> str:
    return "\n".join(f"pdserve / vLLM, {what}: {_x(v)}" for what, v in ratios(results))


def markdown(results: dict) -> str:
    m = results["machine"]
    parts = [
        "# pdserve against vLLM CPU (bench/peers.py)",
        f"CPU: {m['cpu']} ({m['cpus']} CPUs; {m['flags']}); pdserve kernels: {m['isa']}; "
        f"float32 FMA peak {m['peak_gflops']:.0f} GFLOP/s; ceiling {m['ceiling_tok_s']:.0f} tok/s",
    ]
    if results.get("offline"):
        parts += ["## Offline (best of the repetitions)", offline_table(results["offline"])]
    for name, why in (results.get("skipped") or {}).items():
        parts.append(f"{name}: skipped ({why})")
    if results.get("served"):
        w = results["workload"]
        parts += [
            "## Served (AIPerf, chat, streaming)",
            f"{w['prompt_tokens']}-token prompts, {w['output_tokens']} output tokens, "
            f"{w['duration_s']:g} s of Poisson arrivals per rate; SLO TTFT "
            f"{w['slo_ttft_ms']:g} ms, ITL {w['slo_itl_ms']:g} ms",
            served_table(results["served"]),
        ]
    parts += ["## pdserve / vLLM", ratio_lines(results).replace("\n", "  \n")]
    return "\n\n".join(parts) + "\n"


def latency_plot(served: dict, slo_ttft_ms: float, slo_itl_ms: float) -> bytes:
    """TTFT p50 and ITL p50 against the offered rate, a line per system, log scale."""
    plt, fig, axes = figure(2)
    for ax, key, slo, title in (
        (axes[0], "ttft_p50_ms", slo_ttft_ms, "TTFT p50"),
        (axes[1], "itl_p50_ms", slo_itl_ms, "ITL p50"),
    ):
        for name, system in served.items():
            points = [(r["rate"], r[key]) for r in system["runs"] if r[key] is not None]
            if points:
                ax.plot(*zip(*sorted(points), strict=True), marker="o", label=name)
        ax.axhline(slo, color="red", linestyle=":", label="objective")
        ax.set_yscale("log")
        ax.set_xlabel("offered requests / s")
        ax.set_ylabel("ms")
        ax.set_title(title)
    return save(plt, fig, *axes)


def completed_plot(served: dict) -> bytes:
    """Completed against offered requests/s, a line per system, and the diagonal."""
    plt, fig, axes = figure(1)
    top = max((r["rate"] for s in served.values() for r in s["runs"]), default=1.0)
    axes[0].plot([0, top], [0, top], color="grey", linestyle=":", label="completed = offered")
    for name, system in served.items():
        points = sorted((r["rate"], r["completed_req_s"]) for r in system["runs"])
        axes[0].plot(*zip(*points, strict=True), marker="o", label=name)
    axes[0].set_xlabel("offered requests / s")
    axes[0].set_ylabel("completed requests / s")
    axes[0].set_title("throughput against load")
    return save(plt, fig, *axes)
