"""``GET /metrics`` and the request log line of a real disaggregated cluster (the tiny
chat model, gloo, one prefill and one decode instance, ``logging.format: json``),
read with prometheus_client's own parser.

Every check is a difference between two scrapes, so the tests do not depend on each
other's requests."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.cluster.helpers import wait_until
from tests.cluster.test_disagg import disagg_config

PAIR = {"prefill": "prefill-0", "decode": "decode-0"}
LATENCY = ("time_to_first_token_seconds", "e2e_request_latency_seconds",
           "request_queue_time_seconds", "request_prefill_time_seconds",
           "request_decode_time_seconds")  # fmt: skip


@pytest.fixture(scope="module")
def cluster(chat_model):
    from pdserve.cluster import launch

    config = disagg_config(chat_model, "gloo", True, 1)
    config["logging"] = {"format": "json", "level": "INFO"}
    config["slo"] = {"ttft_ms": 60_000, "tpot_ms": 60_000}
    for role in ("prefill", "decode"):  # each instance serves its own metrics too
        config[role]["metrics_port"] = 0
    c = launch(config)
    yield c
    c.shutdown(drain=False)


def scrape(cluster) -> dict[tuple, float]:
    """Every sample of ``/metrics``: (name, sorted labels) -> value."""
    resp = httpx.get(f"http://{cluster.http_address}/metrics")
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/plain; version=0.0.4")
    samples = {}
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((f"pdserve:{name}", tuple(sorted(labels.items()))), 0.0)


def delta(before: dict, after: dict, name: str, **labels) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def bucket_quantile(before: dict, after: dict, name: str, q: float, **labels):
    """Prometheus's ``histogram_quantile`` over the buckets filled between two scrapes:
    (estimate, lower and upper bound of its bucket)."""
    keys = sorted(
        (float(dict(key[1])["le"]), key)
        for key in after
        if key[0] == f"pdserve:{name}_bucket" and set(labels.items()) <= set(key[1])
    )
    counts = [(bound, after[key] - before.get(key, 0.0)) for bound, key in keys]
    rank = q * counts[-1][1]
    lower, below = 0.0, 0.0
    for bound, count in counts:
        if count >= rank:
            return lower + (bound - lower) * (rank - below) / (count - below), lower, bound
        lower, below = bound, count
    raise AssertionError("no bucket holds the quantile")


def test_sharegpt_load_histograms_count_the_requests_and_agree_with_bench(cluster, chat_model):
    from pdserve.loadgen.endpoint import EndpointClient
    from pdserve.loadgen.metrics import SLO
    from pdserve.loadgen.runner import measure
    from pdserve.loadgen.workloads import WorkloadSpec

    spec = WorkloadSpec("sharegpt", max_prompt_tokens=64, max_output_tokens=8,
                        dataset_limit=200)  # fmt: skip
    runs = []
    before = scrape(cluster)
    client = EndpointClient(f"http://{cluster.http_address}")
    measure(client, chat_model, spec, [6.0], 3.0, SLO(60_000, 60_000), warmup=0,
            on_run=lambda rate, summary, records: runs.append((summary, records)))  # fmt: skip
    after = scrape(cluster)
    (summary, records), = runs  # fmt: skip
    assert summary["errors"] == 0 and len(records) == 18
    m = {"model_name": chat_model}
    for name in LATENCY:
        assert delta(before, after, f"{name}_count", **m) == len(records), name
    many = [r for r in records if r.completion_tokens > 1]
    assert delta(before, after, "request_time_per_output_token_seconds_count", **m) == len(many)
    gaps = sum(r.completion_tokens - 1 for r in records)
    assert delta(before, after, "inter_token_latency_seconds_count", **m) == gaps
    assert delta(before, after, "kv_transfer_bytes_count", **PAIR) == len(records)
    assert delta(before, after, "kv_transfer_seconds_count", **PAIR) == len(records)
    assert delta(before, after, "kv_transfer_bytes_sum", **PAIR) > 0
    assert delta(before, after, "request_success_total", **m, finished_reason="length") == len(
        records
    )
    assert delta(before, after, "request_slo_attained_total", **m) == len(records)
    tokens = sum(r.completion_tokens for r in records)
    assert delta(before, after, "generation_tokens_total", **m) == tokens
    assert delta(before, after, "prompt_tokens_total", **m) == sum(r.prompt_tokens for r in records)
    # the TTFT histogram's median (from its buckets) against the one measured at the client:
    # the router stamps the first token before the HTTP layer and the client's loop see it, so
    # the client's median lies at or above the bucket that holds the router's, by at most the
    # client-side overhead (generous: three xdist workers share two cores)
    p50, lower, upper = bucket_quantile(before, after, "time_to_first_token_seconds", 0.5, **m)
    measured = summary["p50_ttft_ms"] / 1000
    assert lower <= measured <= upper + 0.25, (p50, measured, lower, upper)
    assert value(after, "slo_ttft_seconds", **m) == 60.0
    assert value(after, "slo_tpot_seconds", **m) == 60.0


def test_per_instance_gauges(cluster):
    m = {"model_name": cluster.config.model}

    def idle():
        s = scrape(cluster)
        return s if value(s, "num_requests_in_flight", **m) == 0 else None

    s = wait_until(idle, 30)
    assert s is not None
    for name, role in (("prefill-0", "prefill"), ("decode-0", "decode")):
        labels = {"instance": name, "role": role}
        assert value(s, "instance_up", **labels) == 1
        assert value(s, "instance_kv_blocks", **labels) == 256
        assert value(s, "instance_requests_running", **labels) == 0
        assert ("pdserve:num_preemptions_total", (("instance", name),)) in s
    assert value(s, "num_requests_waiting", **m) == 0


def test_each_instance_serves_its_engine_metrics_at_the_listed_target(cluster):
    """``/metrics/targets`` (Prometheus HTTP service discovery) lists each instance's own
    endpoint; a scrape of it counts the instance's engine steps as the router's view of
    the same instance does, once both are read while the cluster is idle."""
    targets = httpx.get(f"http://{cluster.http_address}/metrics/targets", timeout=10).json()
    by_name = {t["labels"]["__meta_pdserve_instance"]: t for t in targets}
    assert sorted(by_name) == ["decode-0", "prefill-0"]
    with cluster.client() as client:
        assert client.complete(prompt_token_ids=list(range(5, 25)), max_tokens=4).text
    m = {"model_name": cluster.config.model}

    def agree(name: str, role: str, address: str):
        router = scrape(cluster)
        if value(router, "num_requests_in_flight", **m) != 0:
            return None
        own = httpx.get(f"http://{address}/metrics", timeout=10)
        assert own.status_code == 200
        labels = (("instance", name), ("role", role))
        steps = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(own.text)
            for s in family.samples
        }.get(("pdserve:engine_step_seconds_count", labels))
        expected = value(router, "instance_steps_total", instance=name, role=role)
        return steps if steps == expected and steps > 0 else None

    for name, role in (("prefill-0", "prefill"), ("decode-0", "decode")):
        (address,) = by_name[name]["targets"]
        assert address.startswith("127.0.0.1:")
        assert by_name[name]["labels"]["__meta_pdserve_role"] == role
        assert wait_until(lambda: agree(name, role, address), 30), name  # noqa: B023


def test_openmetrics_when_the_scraper_asks_for_it(cluster):
    from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse

    accept = "application/openmetrics-text; version=1.0.0"
    resp = httpx.get(f"http://{cluster.http_address}/metrics", headers={"Accept": accept})
    assert resp.headers["content-type"].startswith("application/openmetrics-text")
    families = {f.name: f.type for f in parse(resp.text)}
    assert families["pdserve:time_to_first_token_seconds"] == "histogram"
    assert families["pdserve:request_success"] == "counter"


def test_refusals_are_counted_by_reason(cluster, chat_model):
    import grpc

    base = f"http://{cluster.http_address}"
    m = {"model_name": chat_model}
    before = scrape(cluster)
    body = {"prompt": "hi", "max_tokens": 2}
    assert httpx.post(f"{base}/v1/completions", json={**body, "max_tokens": 0}).status_code == 400
    assert httpx.post(f"{base}/v1/completions", content=b"{").status_code == 400
    assert httpx.post(f"{base}/v1/completions", json={**body, "model": "no"}).status_code == 404
    with cluster.client() as client, pytest.raises(grpc.RpcError) as err:
        client.complete(prompt_token_ids=[5, 6], max_tokens=-1)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    after = scrape(cluster)
    assert delta(before, after, "requests_refused_total", **m, reason="invalid") == 3
    assert delta(before, after, "requests_refused_total", **m, reason="model") == 1
    assert delta(before, after, "requests_refused_total", **m, reason="queue_full") == 0


def test_one_json_log_line_per_request(cluster):
    """The router actor's log (its stderr, in the Ray session folder) holds one JSON
    object for the request, with its instances, tokens, times, KV bytes and attempts."""
    import ray

    with cluster.client() as client:
        done = asyncio.run(
            client.acomplete(
                prompt_token_ids=list(range(5, 45)),
                max_tokens=5,
                ignore_eos=True,
                request_id="log-line-1",
            )  # fmt: skip
        )
    assert done.completion_tokens == 5
    pid = ray.get(cluster.router.pid.remote())
    logs = Path(cluster.session.temp_dir, "session_latest", "logs")

    def lines():
        found = []
        for path in logs.glob(f"worker-*-{pid}.err"):
            for line in path.read_text().splitlines():
                if '"log-line-1"' in line:
                    found.append(json.loads(line))
        return found

    found = wait_until(lines, 20, interval_s=0.2)
    assert found and len(found) == 1, found
    line = found[0]
    assert line["logger"] == "router.requests" and line["level"] == "INFO"
    assert line["outcome"] == "length" and line["instances"] == ["prefill-0", "decode-0"]
    assert line["prompt_tokens"] == 40 and line["output_tokens"] == 5
    assert 0 < line["ttft_ms"] <= line["e2e_ms"] and line["tpot_ms"] > 0
    assert line["kv_bytes"] > 0 and line["attempts"] == 1
    assert "log-line-1 length" in line["message"]
