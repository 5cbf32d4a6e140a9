"""The per-instance view of ``GET /metrics``: one series per engine instance (labels
``instance`` and ``role``), from the instances' own ``stats()`` as the router read
them for this scrape (``RouterCore.stats()``).

A custom prometheus_client collector rather than gauges set in place: the values are
the instances' (their counters restart at 0 with a restarted instance, which
Prometheus reads as a counter reset), and an instance that is down (``dead`` in its
stats) shows ``pdserve:instance_up 0`` and no load.
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

LABELS = ("instance", "role")

# (metric name after "pdserve:", the instance's stats key, help)
GAUGES = (
    ("instance_requests_running", "running", "Requests in the instance's running batch."),
    ("instance_requests_waiting", "queued", "Requests waiting inside the instance."),
    (
        "instance_requests_outstanding",
        "outstanding",
        "Requests the router placed on the instance, not finished.",
    ),
    ("instance_free_kv_blocks", "free_blocks", "Free KV cache blocks."),
    ("instance_kv_blocks", "total_blocks", "KV cache blocks."),
    (
        "instance_prefix_cached_kv_blocks",
        "prefix_cached_blocks",
        "KV blocks registered in the prefix cache (held or not).",
    ),
)
COUNTERS = (
    ("instance_requests", "requests_total", "Requests the router placed on the instance."),
    ("instance_tokens", "tokens_total", "Tokens the instance generated."),
    ("instance_steps", "steps_total", "Engine steps the instance ran."),
    ("instance_kv_bytes", "kv_bytes_total", "KV bytes the instance sent or received."),
    ("instance_restarts", "restarts", "Times the supervisor restarted the instance."),
    # vLLM's prefix_cache_queries / prefix_cache_hits: in tokens; hit rate = hits / queries
    (
        "instance_prefix_cache_queries",
        "prefix_cache_queries_total",
        "Prompt tokens looked up in the prefix cache at admission.",
    ),
    (
        "instance_prefix_cache_hits",
        "prefix_cache_hits_total",
        "Prompt tokens found in the prefix cache at admission (not computed).",
    ),
    (
        "instance_guessed_tokens",
        "guessed_tokens_total",
        "Speculative decoding: guessed tokens verified, summed as requests end.",
    ),
    (
        "instance_accepted_tokens",
        "accepted_tokens_total",
        "Speculative decoding: guessed tokens accepted (output without a step of their own).",
    ),
    (
        "instance_prompt_tokens_computed",
        "prompt_tokens_computed_total",
        "Prompt tokens whose KV the instance computed (a recomputed prompt counts again).",
    ),
)


class InstanceCollector(Collector):
    """Yields the families of ``instances``: the list ``RouterCore.stats()`` returns
    under ``"instances"``, replaced before each scrape."""

    def __init__(self):
        self.instances: list[dict] = []

    def collect(self):
        insts = self.instances

        def labels(inst: dict) -> list[str]:
            return [inst["name"], inst.get("role", "")]

        up = GaugeMetricFamily(
            "pdserve:instance_up", "1 while the instance answers.", labels=LABELS
        )
        for inst in insts:
            up.add_metric(labels(inst), 0 if "dead" in inst else 1)
        yield up
        for kind, table in ((GaugeMetricFamily, GAUGES), (CounterMetricFamily, COUNTERS)):
            for name, key, text in table:
                family = kind(f"pdserve:{name}", text, labels=LABELS)
                for inst in insts:
                    if key in inst:
                        family.add_metric(labels(inst), inst[key])
                yield family
        preemptions = CounterMetricFamily(
            "pdserve:num_preemptions",
            "Running requests preempted (their KV recomputed).",
            labels=("instance",),
        )
        for inst in insts:
            if "preemptions_total" in inst:
                preemptions.add_metric([inst["name"]], inst["preemptions_total"])
        yield preemptions
