"""The router's and instances' load in the Prometheus text format (``GET /metrics``)."""

from __future__ import annotations

ROUTER = (
    ("queued", "gauge", "requests waiting in the router's admission queue"),
    ("max_queue", "gauge", "bound of the admission queue (router.max_queue)"),
    ("in_flight", "gauge", "requests queued or placed, not finished"),
)
INSTANCE = (
    ("queued", "gauge", "requests waiting inside the instance"),
    ("running", "gauge", "requests in the instance's running batch"),
    ("outstanding", "gauge", "requests the router placed there, not finished"),
    ("free_blocks", "gauge", "free KV cache blocks"),
    ("total_blocks", "gauge", "KV cache blocks"),
    ("requests_total", "counter", "requests placed on the instance"),
    ("tokens_total", "counter", "tokens the instance generated"),
    ("steps_total", "counter", "engine steps the instance ran"),
    ("kv_bytes_total", "counter", "KV bytes the instance sent or received"),
)


def prometheus_text(stats: dict) -> str:
    """``RouterCore.stats()`` as Prometheus exposition text."""
    lines = []
    for key, kind, text in ROUTER:
        lines += [f"# HELP pdserve_router_{key} {text}", f"# TYPE pdserve_router_{key} {kind}"]
        lines.append(f"pdserve_router_{key} {int(stats[key])}")
    lines += [
        "# HELP pdserve_router_draining 1 while draining",
        "# TYPE pdserve_router_draining gauge",
    ]
    lines.append(f"pdserve_router_draining {int(stats['draining'])}")
    for key, kind, text in INSTANCE:
        name = f"pdserve_instance_{key}"
        lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
        for inst in stats["instances"]:
            if key in inst:
                labels = f'instance="{inst["name"]}",role="{inst.get("role", "")}"'
                lines.append(f"{name}{{{labels}}} {int(inst[key])}")
    lines += [
        "# HELP pdserve_instance_up 1 while the instance answers",
        "# TYPE pdserve_instance_up gauge",
    ]
    for inst in stats["instances"]:
        labels = f'instance="{inst["name"]}",role="{inst.get("role", "")}"'
        lines.append(f"pdserve_instance_up{{{labels}}} {0 if 'dead' in inst else 1}")
    return "\n".join(lines) + "\n"
