"""deploy/grafana/pdserve.json: every PromQL expression of the dashboard (its panels'
targets and its variables' queries) names only metrics the router exports, as read
with prometheus_client's parser from the exposition text of the registry a router
builds (router/metrics.py), and the panels the dashboard promises are there."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from pdserve.router.metrics import RouterMetrics

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "pdserve.json"
SUFFIXES = {"histogram": ("_bucket", "_sum", "_count"), "counter": ("_total",), "gauge": ("",)}
# PromQL's words that are not metric names (aggregations, keywords; functions are
# recognised by the parenthesis that follows them)
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and",
            "or", "unless", "offset"}  # fmt: skip
IDENTIFIER = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def exported_names() -> set[str]:
    """The sample names a router's ``/metrics`` can hold: each family's, with the
    suffixes of its type."""
    metrics = RouterMetrics("tiny", {"ttft_ms": 1000.0, "tpot_ms": 150.0})
    stats = {"queued": 0, "in_flight": 0, "max_queue": 8, "draining": False, "instances": []}
    body, _ = metrics.exposition(stats)
    text = body.decode()
    names = set()
    for family in text_string_to_metric_families(text):
        names.update(family.name + suffix for suffix in SUFFIXES[family.type])
    return names


def expressions(dashboard: dict) -> list[str]:
    """Every PromQL expression: panel targets (rows' nested panels included) and query
    variables."""
    found = []

    def panels(items):
        for p in items:
            found.extend(t["expr"] for t in p.get("targets", []) if "expr" in t)
            panels(p.get("panels", []))

    panels(dashboard["panels"])
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            query = var["query"]
            found.append(query["query"] if isinstance(query, dict) else query)
    return found


def metric_names(expr: str) -> set[str]:
    """The metric names in one expression: identifiers outside strings, label matchers,
    ranges and grouping lists that are neither a function call, a keyword nor a
    Grafana variable (Grafana's ``label_values(metric, label)``: its metric)."""
    bare = re.sub(r"label_values\(([^,()]*),\s*\w+\)", r"\1", expr)
    bare = re.sub(r'"[^"]*"', "", bare)
    bare = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", bare)
    bare = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", " ", bare)
    bare = re.sub(r"\$\{?\w+\}?", " ", bare)
    names = set()
    for m in IDENTIFIER.finditer(bare):
        word, rest = m.group(), bare[m.end() :].lstrip()
        if rest.startswith("(") or word in KEYWORDS:
            continue
        names.add(word)
    return names


def test_every_query_names_a_metric_the_router_exports():
    dashboard = json.loads(DASHBOARD.read_text())
    exported = exported_names()
    exprs = expressions(dashboard)
    assert len(exprs) >= 12
    used = set()
    for expr in exprs:
        names = metric_names(expr)
        assert names, f"no metric in {expr!r}"
        assert names <= exported, f"{expr!r}: {sorted(names - exported)} not exported"
        used |= names
    # the panels the dashboard promises (docs/serving.md, "Metrics and logs")
    for name in ("request_success_total", "time_to_first_token_seconds_bucket",
                 "request_time_per_output_token_seconds_bucket", "slo_ttft_seconds",
                 "slo_tpot_seconds", "request_slo_attained_total", "kv_transfer_bytes_sum",
                 "kv_transfer_seconds_bucket", "num_requests_waiting",
                 "instance_free_kv_blocks", "instance_up",
                 "instance_prefix_cache_hits_total"):  # fmt: skip
        assert f"pdserve:{name}" in used, name


def test_the_name_check_catches_a_name_the_router_does_not_export():
    expr = 'histogram_quantile(0.9, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket{model_name=~"$m"}[$__rate_interval])))'  # noqa: E501
    assert metric_names(expr) == {"vllm:time_to_first_token_seconds_bucket"}
    assert not metric_names(expr) <= exported_names()
