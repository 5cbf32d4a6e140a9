"""The comparison's plots (matplotlib, Agg backend), as PNG bytes.

- Attainment vs rate, a line per contender; per device (rate / devices) when the
  contenders use different numbers of devices.
- Attainment vs SLO scale at one rate (DistServe's figures): both objectives times
  each factor, attainment recomputed from the records.
- TTFT p50 (solid) and p90 (dashed) vs rate, a log scale: where prefix reuse shows.
- TPOT distribution (CDF) of each contender at the highest rate, with the TPOT
  objective: where prefill interference shows as a tail.
- TTFT of each request against its prompt's length at the highest rate, a log scale:
  prefill time grows with the prompt unless a cache holds it (multi-turn chat with and
  without prefix caching), and where each mode puts long and short prompts shows.
"""

from __future__ import annotations

import io


def figure(panels: int = 1):
    """(pyplot, the figure, its axes): ``panels`` side by side, 6.4 x 4.2 in each, on the
    Agg backend (no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, panels, figsize=(6.4 * panels, 4.2), dpi=100, squeeze=False)
    return plt, fig, list(axes[0])


def _png(plt, fig, ax, target: float) -> bytes:
    ax.axhline(target, color="grey", linestyle=":", linewidth=1, label=f"target {target:.0%}")
    ax.set_ylim(-0.03, 1.03)
    ax.set_ylabel("SLO attainment")
    return save(plt, fig, ax)


def save(plt, fig, *axes) -> bytes:
    """The figure as PNG bytes, each of ``axes`` with a grid and a legend; closes it."""
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def attainment_vs_rate(results: dict) -> bytes:
    plt, fig, (ax,) = figure()
    per_device = not results["same_devices"]
    for c in results["contenders"]:
        points = sorted((run["rate"], run["summary"]["attainment"]) for run in c["runs"])
        xs = [rate / c["devices"] if per_device else rate for rate, _ in points]
        ax.plot(xs, [a for _, a in points], marker="o", label=c["name"])
    ax.set_xlabel("requests / s per device" if per_device else "requests / s")
    slo = results["slo"]
    ax.set_title(f"TTFT {slo['ttft_ms']:g} ms, TPOT {slo['tpot_ms']:g} ms")
    return _png(plt, fig, ax, slo["attainment"])


def attainment_vs_slo_scale(results: dict) -> bytes:
    plt, fig, (ax,) = figure()
    curve = results["slo_scale"]
    for name, values in curve["attainment"].items():
        ax.plot(curve["scales"], values, marker="o", label=name)
    slo = results["slo"]
    ax.set_xlabel(f"SLO scale (1 = TTFT {slo['ttft_ms']:g} ms, TPOT {slo['tpot_ms']:g} ms)")
    ax.set_title(f"at {curve['rate']:g} requests / s")
    return _png(plt, fig, ax, slo["attainment"])


def ttft_vs_rate(results: dict) -> bytes:
    plt, fig, (ax,) = figure()
    for i, c in enumerate(results["contenders"]):
        runs = sorted(c["runs"], key=lambda run: run["rate"])
        color = f"C{i}"
        for q, style in ((50, "-"), (90, "--")):
            points = [(r["rate"], r["summary"][f"p{q}_ttft_ms"]) for r in runs]
            points = [(x, y) for x, y in points if y is not None]
            if points:
                xs, ys = zip(*points, strict=True)
                label = f"{c['name']} p{q}"
                ax.plot(xs, ys, style, color=color, marker="o", label=label)
    ax.axhline(results["slo"]["ttft_ms"], color="red", linestyle=":", label="TTFT objective")
    ax.set_yscale("log")
    ax.set_xlabel("requests / s")
    ax.set_ylabel("TTFT ms")
    ax.set_title("TTFT p50 and p90")
    return save(plt, fig, ax)


def tpot_cdf(results: dict) -> bytes:
    plt, fig, (ax,) = figure()
    rate = max(results["rates"])
    for c in results["contenders"]:
        runs = [run for run in c["runs"] if run["rate"] == rate]
        tpots = sorted(r["tpot_ms"] for run in runs for r in run["records"] if not r["error"])
        if tpots:
            ys = [(i + 1) / len(tpots) for i in range(len(tpots))]
            ax.step(tpots, ys, where="post", label=c["name"])
    slo = results["slo"]
    ax.axvline(slo["tpot_ms"], color="red", linestyle="--", linewidth=1, label="TPOT objective")
    ax.set_xlabel("TPOT ms")
    ax.set_ylabel("share of requests")
    ax.set_title(f"TPOT distribution at {rate:g} requests / s")
    return save(plt, fig, ax)


def ttft_vs_prompt(results: dict) -> bytes:
    plt, fig, (ax,) = figure()
    rate = max(results["rates"])
    for c in results["contenders"]:
        records = [r for run in c["runs"] if run["rate"] == rate for r in run["records"]]
        points = [(r["prompt_tokens"], r["ttft_ms"]) for r in records if not r["error"]]
        if points:
            xs, ys = zip(*points, strict=True)
            ax.scatter(xs, ys, s=12, alpha=0.6, label=c["name"])
    ax.axhline(results["slo"]["ttft_ms"], color="red", linestyle=":", label="TTFT objective")
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("TTFT ms")
    ax.set_title(f"TTFT by prompt length at {rate:g} requests / s")
    return save(plt, fig, ax)
