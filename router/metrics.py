"""The router's Prometheus metrics (``GET /metrics``), through prometheus_client
(docs/serving.md, "Metrics and logs" lists every name).

``RouterMetrics`` owns one ``CollectorRegistry`` per router (never the process-wide
default one, so two routers in one process never mix). Names carry the ``pdserve:``
prefix as vLLM's carry ``vllm:``, with vLLM's buckets for the same quantity; request
metrics carry the label ``model_name`` (the config's ``model``).

Where each observation happens (all on the router's event loop):
- ``refused(reason)``: once per refused call or request, whichever part refused it
  (``REFUSAL_REASONS``);
- ``migrated()``: once per request moved to another instance after a failure;
- ``prefill_placed(where, reason)``: hybrid mode, once per attempt placed
  (``PREFILL_REASONS``, router/prefill_choice.py);
- ``finished(stream, outcome)``: once per admitted request, when its front end lets
  it go (``RouterCore.finish``). ``request_success_total`` counts every outcome but a
  refusal; the latency histograms, the token counters' output side and SLO attainment
  count only requests served to their end (``stop`` or ``length``);
- ``exposition(stats, accept, peers)``: a scrape, in the format its ``Accept`` header
  asks for (prometheus_client's negotiation: the Prometheus text format unless the
  scraper asks for OpenMetrics); the gauges of the queue and the per-instance view
  (router/metrics_instances.py) come from that moment's ``RouterCore.stats()``. With
  router replicas (router/replicas.py), the other replicas' ``samples()``: each
  series of the request metrics (the counters and histograms above) is their sum over
  the replicas, whichever one is scraped.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import Metric
from prometheus_client.samples import Sample

from pdserve.router.metrics_instances import InstanceCollector
from pdserve.router.prefill_choice import REASONS as PREFILL_REASONS
from pdserve.router.stream import RequestStream

SERVED = ("stop", "length")  # the finish reasons of a request served to its end

# vLLM's buckets for the same quantities (its time_to_first_token_seconds,
# inter_token_latency_seconds, request latency and NIXL transfer histograms)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
TOKEN_GAP_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                     2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
KV_SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)
KV_BYTES_BUCKETS = tuple(2 ** (10 + i) for i in range(1, 25, 2))  # 2 KiB .. 8 GiB

# why a call or a request was refused (the label ``reason`` of requests_refused_total)
REFUSAL_REASONS = (
    "invalid",  # a field, a limit (router.max_prompt_tokens, ...), an unparsable body
    "exists",  # its request_id is in flight
    "unauthenticated",  # no known API key
    "model",  # the body names a model not served here
    "body_too_large",  # past router.max_body_bytes
    "queue_full",  # router.max_queue
    "queue_timeout",  # router.queue_timeout_s
    "expected_ttft",  # router.max_expected_ttft_s
    "concurrency",  # router.max_concurrent_requests
    "concurrency_per_key",  # router.max_concurrent_requests_per_key
    "concurrency_per_address",  # router.max_concurrent_requests_per_address
    "body_timeout",  # the body not in within router.body_timeout_s
    "unavailable",  # loading, draining, or every instance has failed
    "deadline",  # the request's own deadline passed
)


class RouterMetrics:
    """One router's metrics, in ``registry``. Invariants: every series of a counter with
    a fixed label set (refusal reasons, finish reasons) exists from the start, at 0; a
    request is observed once (``finished``), a refusal once (``refused``)."""

    def __init__(self, model_name: str, slo: dict):
        """``slo``: the cluster's ``slo`` section (``ttft_ms``, ``tpot_ms``). Turns off
        prometheus_client's ``_created`` series, for the whole process (they double the
        series and nothing here reads them)."""
        disable_created_metrics()
        self.registry = CollectorRegistry()
        self.slo_ttft_s = slo["ttft_ms"] / 1000.0
        self.slo_tpot_s = slo["tpot_ms"] / 1000.0
        r, m = self.registry, ("model_name",)

        def histogram(name, text, buckets, labels=m):
            return Histogram(f"pdserve:{name}", text, labels, registry=r, buckets=buckets)

        def counter(name, text, labels=m):
            return Counter(f"pdserve:{name}", text, labels, registry=r)

        def gauge(name, text, labels=m):
            return Gauge(f"pdserve:{name}", text, labels, registry=r)

        self.ttft = histogram(
            "time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS
        )
        self.itl = histogram(
            "inter_token_latency_seconds",
            "Gap between two streamed tokens of a request.",
            TOKEN_GAP_BUCKETS,
        )
        self.tpot = histogram(
            "request_time_per_output_token_seconds",
            "Mean gap between the tokens after the first, per request.",
            TOKEN_GAP_BUCKETS,
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds", "Arrival to last token.", REQUEST_LATENCY_BUCKETS
        )
        self.queue = histogram(
            "request_queue_time_seconds",
            "Arrival to sent to an instance (the router's queue).",
            REQUEST_LATENCY_BUCKETS,
        )
        self.prefill = histogram(
            "request_prefill_time_seconds",
            "Sent to an instance to first token.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.decode = histogram(
            "request_decode_time_seconds", "First token to last token.", REQUEST_LATENCY_BUCKETS
        )
        pair = ("prefill", "decode")
        self.kv_bytes = histogram(
            "kv_transfer_bytes",
            "KV bytes moved for a request, per (prefill, decode) pair.",
            KV_BYTES_BUCKETS,
            pair,
        )
        self.kv_seconds = histogram(
            "kv_transfer_seconds",
            "KV transfer time of a request, per pair.",
            KV_SECONDS_BUCKETS,
            pair,
        )
        self.success = counter(
            "request_success",
            "Requests ended, by finish reason.",
            ("model_name", "finished_reason"),
        )
        self.slo_attained = counter(
            "request_slo_attained", "Requests served meeting both slo.ttft_ms and slo.tpot_ms."
        )
        self.refusals = counter(
            "requests_refused", "Calls and requests refused, by reason.", ("model_name", "reason")
        )
        self.migrations = counter(
            "request_migrations", "Requests moved to another instance after a failure."
        )
        self.prefill_placement = counter(
            "prefill_placement",
            "Hybrid mode: where attempts' prompts were computed (local: on their decode "
            "instance; remote: on the prefill pool), and why.",
            ("model_name", "where", "reason"),
        )
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of admitted requests.")
        self.generation_tokens = counter("generation_tokens", "Tokens streamed to clients.")
        self.waiting = gauge("num_requests_waiting", "Requests in the router's queue.")
        self.in_flight = gauge("num_requests_in_flight", "Requests queued or placed.")
        self.max_queue = gauge("router_max_queue", "The queue's bound (router.max_queue).")
        self.draining = gauge("router_draining", "1 while the router drains.")
        gauge("slo_ttft_seconds", "The TTFT objective (slo.ttft_ms).").labels(model_name).set(
            self.slo_ttft_s
        )
        gauge("slo_tpot_seconds", "The TPOT objective (slo.tpot_ms).").labels(model_name).set(
            self.slo_tpot_s
        )
        self.model_name = model_name
        self.instances = InstanceCollector()
        r.register(self.instances)
        for reason in REFUSAL_REASONS:  # every series present from the start, at 0
            self.refusals.labels(model_name, reason)
        for reason in (*SERVED, "abort", "error"):
            self.success.labels(model_name, reason)
        for where, reason in PREFILL_REASONS:
            self.prefill_placement.labels(model_name, where, reason)
        for metric in (
            self.slo_attained,
            self.migrations,
            self.prompt_tokens,
            self.generation_tokens,
        ):
            metric.labels(model_name)
        # what a scrape sums over the router replicas: every request metric
        self._summed = (
            self.ttft,
            self.itl,
            self.tpot,
            self.e2e,
            self.queue,
            self.prefill,
            self.decode,
            self.kv_bytes,
            self.kv_seconds,
            self.success,
            self.slo_attained,
            self.refusals,
            self.migrations,
            self.prefill_placement,
            self.prompt_tokens,
            self.generation_tokens,
        )
        self._summed_names = {family.name for m in self._summed for family in m.collect()}

    def refused(self, reason: str) -> None:
        if reason not in REFUSAL_REASONS:
            raise ValueError(f"refusal reason={reason!r}: allowed are {REFUSAL_REASONS}")
        self.refusals.labels(self.model_name, reason).inc()

    def prefill_placed(self, where: str, reason: str) -> None:
        """Hybrid mode placed an attempt's prefill (router/prefill_choice.py)."""
        if (where, reason) not in PREFILL_REASONS:
            raise ValueError(f"prefill placement {where}:{reason}: allowed are {PREFILL_REASONS}")
        self.prefill_placement.labels(self.model_name, where, reason).inc()

    def migrated(self) -> None:
        self.migrations.labels(self.model_name).inc()

    def finished(self, stream: RequestStream, outcome: str) -> None:
        """An admitted request ended with ``outcome``: a finish reason (stop, length,
        abort) or ``error``; a refused one is counted by ``refused`` instead."""
        m = self.model_name
        self.success.labels(m, outcome).inc()
        self.prompt_tokens.labels(m).inc(len(stream.prompt_ids))
        self.generation_tokens.labels(m).inc(stream.num_tokens)
        clock = stream.clock
        if outcome not in SERVED or clock.first_token_at is None:
            return
        # a stream with a first token was placed (``sent_to``) and has a last one too
        assert clock.dispatched_at is not None and clock.last_token_at is not None
        t = stream.timings()
        ttft, tpot = t.ttft_ms / 1000.0, t.tpot_ms / 1000.0
        self.ttft.labels(m).observe(ttft)
        self.e2e.labels(m).observe(t.e2e_ms / 1000.0)
        self.queue.labels(m).observe(t.queue_ms / 1000.0)
        self.prefill.labels(m).observe(max(0.0, clock.first_token_at - clock.dispatched_at))
        self.decode.labels(m).observe(clock.last_token_at - clock.first_token_at)
        itl = self.itl.labels(m)
        for gap in token_gaps(clock.token_walls):
            itl.observe(gap)
        if stream.num_tokens > 1:
            self.tpot.labels(m).observe(tpot)
        if ttft <= self.slo_ttft_s and tpot <= self.slo_tpot_s:
            self.slo_attained.labels(m).inc()
        if t.kv_bytes and len(stream.attempt.pair) == 2:
            self.kv_bytes.labels(*stream.attempt.pair).observe(t.kv_bytes)
            self.kv_seconds.labels(*stream.attempt.pair).observe(t.transfer_ms / 1000.0)

    def samples(self) -> dict[str, list[tuple[str, dict, float]]]:
        """The request metrics' series, by family name: (sample name, labels, value)
        each; what another router replica adds to its own in a scrape."""
        return {
            family.name: [(s.name, s.labels, s.value) for s in family.samples]
            for metric in self._summed
            for family in metric.collect()
        }

    def exposition(
        self, stats: dict, accept: str = "", peers: Sequence[dict] = ()
    ) -> tuple[bytes, str]:
        """(the registry, its content type) in the format ``accept`` (the scraper's
        ``Accept`` header) asks for, with the gauges of ``stats``
        (``RouterCore.stats()``: the queue, every instance's load) and each request
        series summed with the other router replicas' (``peers``: their ``samples()``)."""
        m = self.model_name
        self.waiting.labels(m).set(stats["queued"])
        self.in_flight.labels(m).set(stats["in_flight"])
        self.max_queue.labels(m).set(stats["max_queue"])
        self.draining.labels(m).set(int(stats["draining"]))
        self.instances.instances = stats["instances"]
        encode, content_type = choose_encoder(accept)
        return encode(_Summed(self.registry, self._summed_names, peers)), content_type


class _Summed:
    """A registry's families as a scrape reads them (``collect``), the families named in
    ``names`` with each series' value summed with ``peers``' (``RouterMetrics.samples``);
    a series only a peer has comes after the registry's of its family."""

    def __init__(self, registry: CollectorRegistry, names: set[str], peers: Sequence[dict]):
        self.registry, self.names, self.peers = registry, names, peers

    def collect(self):
        for family in self.registry.collect():
            if family.name not in self.names or not self.peers:
                yield family
                continue
            extra: dict[tuple, float] = {}
            for peer in self.peers:
                for name, labels, value in peer.get(family.name, ()):
                    key = (name, tuple(sorted(labels.items())))
                    extra[key] = extra.get(key, 0.0) + value
            summed = Metric(family.name, family.documentation, family.type, family.unit)
            for s in family.samples:
                key = (s.name, tuple(sorted(s.labels.items())))
                summed.samples.append(s._replace(value=s.value + extra.pop(key, 0.0)))
            for (name, labels), value in extra.items():
                summed.samples.append(Sample(name, dict(labels), value))
            yield summed


def token_gaps(walls: list[float]) -> list[float]:
    """The gaps between a request's consecutive tokens, from the time each reached the
    router (``walls``, ascending). Tokens that arrive in one batch share a time: a batch
    of k tokens after an earlier one counts as k gaps of equal share of the time since
    it; tokens of the first batch after the first token count as gaps of 0. The gaps
    sum to last - first, so their mean is the request's TPOT."""
    gaps: list[float] = []
    i, n = 1, len(walls)
    while i < n and walls[i] == walls[0]:  # the first batch
        gaps.append(0.0)
        i += 1
    while i < n:
        j = i
        while j < n and walls[j] == walls[i]:
            j += 1
        share = max(0.0, walls[i] - walls[i - 1]) / (j - i)
        gaps += [share] * (j - i)
        i = j
    return gaps
