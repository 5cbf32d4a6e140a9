"""Why a candidate's goodput stops where it does, from the simulated records of the
lowest rate that missed the target: which objective fails, and which phase makes it."""

from __future__ import annotations

from pdserve.loadgen.metrics import SLO, summarize
from pdserve.planner.search import Candidate


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def limiter(c: Candidate, slo: SLO) -> str:
    """One sentence: what breaks the objectives just above the goodput."""
    rate = c.goodput.lowest_failing if c.goodput else None
    if rate is None:
        top = max(c.runs, default=0)
        return f"meets the target at every simulated rate (up to {top:.3g} req/s)"
    records = [r for r in c.runs[rate] if r.ok]
    s = summarize(c.runs[rate], slo)
    head = (
        f"at {rate:.3g} req/s attainment {s['attainment']:.2f} "
        f"(TTFT {s['attainment_ttft']:.2f}, TPOT {s['attainment_tpot']:.2f})"
    )
    queue = _mean([r.queue_ms for r in records])
    prefill = _mean([r.phases["prefill_end"] - r.queue_ms for r in records])
    transfer = _mean([r.transfer_ms for r in records])
    tpot = s["p90_tpot_ms"] or 0.0
    split = f"mean router queue {queue:.0f} ms, prefill wait+compute {prefill:.0f} ms"
    if c.cluster.mode != "colocated":
        split += f", exposed KV transfer {transfer:.1f} ms"
    if s["attainment_ttft"] <= s["attainment_tpot"]:
        if queue > prefill:
            where = (
                "decode capacity: requests wait at the router for a decode slot "
                "(max_batch_size / KV blocks)"
                if c.cluster.mode != "colocated"
                else "instance slots: requests wait at the router (max_batch_size / KV blocks)"
            )
        else:
            where = (
                "prefill queueing: the prefill pool is saturated"
                if c.cluster.mode != "colocated"
                else "prefill queueing: prompt chunks wait behind other prompts and decodes"
            )
        return f"{head}: TTFT breaks first, {where} ({split})"
    if c.cluster.mode == "colocated":
        why = "prefill interference: prompt chunks share steps with the running decodes"
    else:
        why = "decode batch: the step time of the growing batch (context) passes the TPOT"
    return f"{head}: TPOT breaks first (p90 {tpot:.0f} ms vs {slo.tpot_ms:g} ms), {why}"


def report(ranked: list[Candidate], phase: dict, slo: SLO, top: int = 5) -> list[str]:
    lines = ["rank  placement                             devices  goodput  per device"]
    for i, c in enumerate(ranked[:top], 1):
        lines.append(
            f"{i:>4}  {c.cluster.describe():<37} {c.cluster.devices:>7}  "
            f"{c.value:>7.3g}  {c.per_device:>10.3g}"
        )
    if not ranked:
        return lines + ["no placement fits (the weights do not fit the devices)"]
    win = ranked[0]
    lines.append(f"winner: {win.cluster.describe()}: {win.value:.3g} req/s")
    lines.append(f"  limited by: {limiter(win, slo)}")
    if win.cluster.mode != "colocated":
        p, d = win.cluster.prefill, win.cluster.decode
        gp, gd = phase.get(("prefill", p.tp), 0), phase.get(("decode", d.tp), 0)
        lines.append(
            f"  alone, its prefill pool sustains {p.instances * gp:.3g} req/s and its "
            f"decode pool {d.instances * gd:.3g} req/s "
            f"(the {'prefill' if p.instances * gp < d.instances * gd else 'decode'} "
            "pool is the tighter one)"
        )
    other = [c for c in ranked[1:] if c.cluster.mode != win.cluster.mode]
    if other:
        o = other[0]
        lines.append(f"  best {o.cluster.mode}: {o.cluster.describe()}: {o.value:.3g} req/s")
        lines.append(f"    limited by: {limiter(o, slo)}")
    return lines
