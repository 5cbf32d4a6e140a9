"""The chaos run's report: every figure in one dict (written as JSON), the tables
printed at the end, and the timeline plot (PNG).

``passed`` is the gate (loadgen/chaos_verdict.py, ``gate``; ``reasons`` say why not): at
least one signal sent, every signalled process recovered within the bound, no failed
request, no mismatched stream, no leaked block, and every instance's blocks checked
(an instance that could not be checked may hold leaked blocks: it fails the gate too).
Per role: the signals sent, those recovered and the slowest recovery.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

from pdserve.loadgen.chaos_killer import INSTANCE_ROLES
from pdserve.loadgen.chaos_load import StreamRecord
from pdserve.loadgen.chaos_timeline import Sample, control_recovery, recovery
from pdserve.loadgen.chaos_verdict import KINDS, gate, verdict

JSON_NAME, PLOT_NAME = "chaos.json", "chaos-timeline.png"


def summarize(
    records: list[StreamRecord],
    expected: list[list[int]],
    kills: list,
    samples: list[Sample],
    integrity: dict[str, dict],
    recover_s: float,
) -> dict:
    """The figures of a run: per request, per kill, per role, per instance, their counts
    and the gate (a kill recovered later than ``recover_s`` fails it)."""
    requests = []
    for rec, want in zip(records, expected, strict=True):
        v = verdict(want, rec.token_ids) if rec.completed else None
        requests.append({**rec.to_dict(), "verdict": None if v is None else v.to_dict()})
    kinds = {k: sum(1 for r in requests if (r["verdict"] or {}).get("kind") == k) for k in KINDS}
    kill_rows = []
    for k in kills:
        row = k.to_dict()
        if k.skipped is None and k.role in INSTANCE_ROLES:
            row["recovery"] = recovery(k.t, k.target, samples)
        elif k.skipped is None:
            row["recovery"] = control_recovery(k.t, k.target, k.pid, samples)
        kill_rows.append(row)
    leaked = {n: i["leaked"] for n, i in integrity.items() if i.get("leaked")}
    unchecked = sorted(n for n, i in integrity.items() if "error" in i)
    summary = {
        "requests": len(records),
        "completed": sum(r.completed for r in records),
        "failed": sum(not r.completed for r in records),
        "migrated": sum(r.completed and r.attempts > 1 for r in records),
        "mismatched": sum(r.completed for r in records) - kinds["ok"],
        **{k: kinds[k] for k in KINDS if k != "ok"},
        "leaked_blocks": sum(leaked.values()),
        "unchecked_instances": unchecked,
        "kills": sum(k.skipped is None for k in kills),
        "recovered": sum(r.get("recovery", {}).get("status") == "recovered" for r in kill_rows),
    }
    summary["roles"] = _per_role(kill_rows)
    summary["reasons"] = gate(summary, kill_rows, recover_s)
    summary["passed"] = not summary["reasons"]
    return {
        "summary": summary,
        "requests": requests,
        "kills": kill_rows,
        "integrity": integrity,
        "timeline": [s.to_dict() for s in samples],
    }


def _per_role(kill_rows: list[dict]) -> dict[str, dict]:
    """Per role signalled: ``kills``, ``recovered``, ``slowest_s`` (None: none recovered)."""
    roles: dict[str, dict] = {}
    for k in kill_rows:
        if k["skipped"] is not None:
            continue
        r = roles.setdefault(k["role"], {"kills": 0, "recovered": 0, "slowest_s": None})
        r["kills"] += 1
        if k["recovery"]["status"] == "recovered":
            r["recovered"] += 1
            r["slowest_s"] = max(r["slowest_s"] or 0.0, k["recovery"]["seconds"])
    return roles


def _table(header: list[str], rows: list[list]) -> str:
    cells = [header, *[[("-" if c is None else str(c)) for c in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(lines)


SUMMARY_ROWS = (
    ("requests", "requests"),
    ("completed", "completed"),
    ("failed", "failed"),
    ("migrated", "migrated (attempts > 1)"),
    ("mismatched", "mismatched (completed, not the expected tokens)"),
    ("duplicate", "  duplicate (a run re-emitted)"),
    ("missing", "  missing (a run skipped, or the tail)"),
    ("diverged", "  diverged (different tokens)"),
    ("leaked_blocks", "leaked blocks"),
    ("kills", "signals sent"),
    ("recovered", "recovered"),
)


def format_report(results: dict) -> str:
    s = results["summary"]
    out = [_table(["", "count"], [[label, s[key]] for key, label in SUMMARY_ROWS])]
    if results["kills"]:
        rows = []
        for k in results["kills"]:
            rec = k.get("recovery") or {}
            took = rec.get("seconds")
            what = k["skipped"] or (f"{took:.1f} s" if took is not None else rec["status"])
            sig = f"SIG{k['signal']}"
            rows.append([f"+{k['t']:.1f} s", k["target"], k["rank"], k["pid"], sig, what])
        header = ["time", "target", "rank", "pid", "signal", "recovery"]
        out += ["", "kills:", _table(header, rows)]
    if s["roles"]:
        rows = []
        for role, r in s["roles"].items():
            slowest = None if r["slowest_s"] is None else f"{r['slowest_s']:.1f} s"
            rows.append([role, r["kills"], r["recovered"], slowest])
        out += ["", "per role:", _table(["role", "signals", "recovered", "slowest"], rows)]
    rows = []
    for name, i in results["integrity"].items():
        if "error" in i:
            rows.append([name, None, None, f"not checked: {i['error']}"])
        else:
            rows.append([name, i["free_blocks"], i["total_blocks"], i["leaked"]])
    out += ["", "blocks after the load:", _table(["instance", "free", "total", "leaked"], rows)]
    bad = [r for r in results["requests"] if r["error"] or r["verdict"]["kind"] != "ok"]
    if bad:
        out += ["", "requests not completed as expected:"]
        for r in bad[:20]:
            why = r["error"].splitlines()[0] if r["error"] else _describe(r["verdict"])
            got = f"{len(r['token_ids'])} tokens streamed"
            on = ", ".join(r["instances"]) or "-"
            out.append(f"  #{r['index']} ({got}, attempts {r['attempts']}, on {on}): {why}")
        if len(bad) > 20:
            out.append(f"  ... {len(bad) - 20} more in the JSON")
    if s["reasons"]:
        out += ["", "the gate failed:", *(f"  {r}" for r in s["reasons"])]
    return "\n".join(out)


def _describe(v: dict) -> str:
    from pdserve.loadgen.chaos_verdict import Verdict

    return Verdict(**v).describe()


def plot_timeline(results: dict) -> bytes:
    """In-flight requests and live instances over time, kills as vertical lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(8, 5), dpi=100)
    samples = [s for s in results["timeline"] if s["error"] is None]
    ts = [s["t"] for s in samples]
    top.step(ts, [s["in_flight"] for s in samples], where="post", label="in flight")
    top.set_ylim(0, max([1, *(s["in_flight"] for s in samples)]) * 1.15)
    top.set_ylabel("requests in flight")
    bottom.step(ts, [s["live"] for s in samples], where="post", color="green", label="serving")
    total = max((len(s["states"]) for s in samples), default=0)
    bottom.set_ylim(-0.2, total + 0.5)
    bottom.set_ylabel("instances serving")
    bottom.set_xlabel("seconds since the load started")
    gaps = [s["t"] for s in results["timeline"] if s["error"] is not None]
    if gaps:
        bottom.plot(gaps, [0] * len(gaps), "x", color="grey", label="router did not answer")
    for k in results["kills"]:
        if k["skipped"] is None:
            color = "red" if k["signal"] == "KILL" else "orange"
            for ax in (top, bottom):
                ax.axvline(k["t"], color=color, linestyle="--", linewidth=1)
            label, at = f"{k['target']}:{k['rank']}", (k["t"], 1)
            top.annotate(
                label,
                at,
                xycoords=("data", "axes fraction"),
                rotation=90,
                va="top",
                ha="right",
                fontsize=7,
            )
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", fontsize=8)
    top.set_title("chaos: kills (dashed) against load and capacity")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def write(results: dict, out: str | Path) -> tuple[Path, Path]:
    """``chaos.json`` and ``chaos-timeline.png`` under ``out`` (created)."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    path, plot = folder / JSON_NAME, folder / PLOT_NAME
    path.write_text(json.dumps(results, indent=1))
    plot.write_bytes(plot_timeline(results))
    return path, plot
