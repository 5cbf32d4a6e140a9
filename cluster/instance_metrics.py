"""Each engine instance's own metrics, served by the instance (docs/serving.md, "Metrics
and logs"): the engine's view, per step, beside the router's request view.

``metered(worker_class)`` is the worker class the cluster starts as rank 0 of an
instance of a pool with ``metrics_port`` set: the same class, whose instances observe
every engine step (``EngineWorker.step_observers``) into their own prometheus_client
registry and serve it at ``GET /metrics`` on ``<advertise>:<port>`` (the pool's KV
interface; port 0: any free one). ``ready()`` then names that address under
``"metrics"``, and the router lists every serving instance's address for Prometheus'
HTTP service discovery (``GET /metrics/targets``, router/http_api.py). Series, labels
``instance`` and ``role``:

    pdserve:engine_step_seconds         histogram  one turn of the step loop
    pdserve:engine_step_tokens          histogram  tokens the step computed
    pdserve:engine_requests_running     gauge      requests in the running batch
    pdserve:engine_requests_waiting     gauge      requests waiting in the instance
    pdserve:engine_free_kv_blocks       gauge      free KV cache blocks
    pdserve:engine_preemptions_total    counter    running requests preempted

Closed by default: no port unless the pool sets one, and with the router's API keys
configured a scrape must present one of them (``Authorization: Bearer <key>``, checked
against the keys' digests, which are all the instance is given); a pool off loopback
without keys is refused at load unless ``router.insecure`` (cluster/security_checks.py).
"""

from __future__ import annotations

import logging
import threading
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from pdserve.engine.scheduler import StepShape
from pdserve.router.auth import ApiKeys

log = logging.getLogger(__name__)

STEP_SECONDS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0]
STEP_TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]


class InstanceMetrics:
    """The metrics of one instance in a registry of its own; ``observe`` is its step
    observer (called on the instance's step loop only)."""

    def __init__(self, name: str, role: str):
        self.registry = CollectorRegistry(auto_describe=True)
        labels = {"instance": name, "role": role}

        def make(kind, metric: str, text: str, **kw):
            m = kind(f"pdserve:engine_{metric}", text, list(labels), registry=self.registry, **kw)
            return m.labels(**labels)

        self.step_seconds = make(
            Histogram, "step_seconds", "One turn of the step loop.", buckets=STEP_SECONDS
        )
        self.step_tokens = make(
            Histogram, "step_tokens", "Tokens one step computed.", buckets=STEP_TOKENS
        )
        self.running = make(Gauge, "requests_running", "Requests in the running batch.")
        self.waiting = make(Gauge, "requests_waiting", "Requests waiting in the instance.")
        self.free_blocks = make(Gauge, "free_kv_blocks", "Free KV cache blocks.")
        self.preemptions = make(Counter, "preemptions", "Running requests preempted.")
        self._preempted = 0  # preemptions_total at the previous step
        self._failed = False  # one log line for a broken recorder, not one per step
        self.name = name

    def observe(self, shape: StepShape, seconds: float, stats: dict) -> None:
        """Never raises: the step loop must not stop for its metrics."""
        try:
            self.step_seconds.observe(seconds)
            self.step_tokens.observe(shape.prefill_tokens + shape.decodes)
            self.running.set(stats["running"])
            self.waiting.set(stats["queued"])
            self.free_blocks.set(stats["free_blocks"])
            new = stats["preemptions_total"] - self._preempted
            if new > 0:
                self.preemptions.inc(new)
            self._preempted = stats["preemptions_total"]
        except Exception:
            if not self._failed:
                log.exception("%s: recording its metrics failed", self.name)
            self._failed = True


class _Quiet(WSGIRequestHandler):
    def log_message(self, format, *args) -> None:  # scrapes are not worth a log line
        pass


class MetricsServer:
    """``GET /metrics`` of one registry on ``bind:port`` in a thread; every other path
    is 404, and with ``keys`` enabled a request without one of them is 401."""

    def __init__(self, registry: CollectorRegistry, bind: str, port: int, keys: ApiKeys):
        exposition = make_wsgi_app(registry)

        def app(environ, start_response):
            if environ.get("PATH_INFO") != "/metrics":
                start_response("404 Not Found", [("Content-Type", "text/plain")])
                return [b"not found; allowed: GET /metrics\n"]
            if keys.owner(environ.get("HTTP_AUTHORIZATION")) is None:
                start_response("401 Unauthorized", [("WWW-Authenticate", "Bearer")])
                return [b"missing or unknown API key\n"]
            return exposition(environ, start_response)

        server_class = type("Server", (ThreadingWSGIServer,), {"address_family": _family(bind)})
        try:
            self._server = make_server(bind, port, app, server_class, _Quiet)
        except OSError as e:
            raise RuntimeError(f"metrics_port={port}: cannot bind {bind}:{port} ({e})") from e
        self.port = self._server.server_port
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="metrics-http", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _family(bind: str):
    import socket

    return socket.AF_INET6 if ":" in bind else socket.AF_INET


def metered(worker_class: type) -> type:
    """``worker_class`` whose instances record ``InstanceMetrics`` and serve them; its
    constructor takes ``metrics={"bind", "advertise", "port", "key_digests"}`` besides
    the worker's arguments (the same class name, so Ray's state API lists the actor
    under the worker's class)."""
    from pdserve.kv_transfer.protocol import endpoint

    class Metered(worker_class):
        def __init__(self, name: str, *args, metrics: dict, **kwargs):
            super().__init__(name, *args, **kwargs)
            recorder = InstanceMetrics(name, self.role)
            bind, advertise = endpoint(metrics["bind"], metrics["advertise"])
            keys = ApiKeys.of_digests([bytes.fromhex(d) for d in metrics["key_digests"]])
            self._metrics_server = MetricsServer(recorder.registry, bind, metrics["port"], keys)
            host = f"[{advertise}]" if ":" in advertise else advertise
            self._metrics_address = f"{host}:{self._metrics_server.port}"
            self.step_observers.append(recorder.observe)

        def ready(self) -> dict:
            return {**super().ready(), "metrics": self._metrics_address}

        def stop(self) -> None:
            self._metrics_server.stop()
            super().stop()

    Metered.__name__ = Metered.__qualname__ = worker_class.__name__
    return Metered
