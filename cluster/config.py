"""The cluster configuration (docs/serving.md, "Configuration") as dataclasses, nested per role.

YAML only fills these (``cluster.config_loader.load_config``). Each field may carry
a check in its metadata; a failing check names the dotted key, the value and what
is allowed, before any Ray process starts.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from pdserve.cluster.placement_groups import ray_labels, ray_resources
from pdserve.engine.attention import BACKENDS
from pdserve.engine.config import DTYPES
from pdserve.router.policies import POLICIES
from pdserve.router.request_log import FORMATS as LOG_FORMATS
from pdserve.router.request_log import LEVELS as LOG_LEVELS

MODES = ("colocated", "disaggregated", "hybrid")
KV_BACKENDS = ("gloo", "nccl", "grpc")

# A check returns None when the value is fine, else what is allowed.
Check = Callable[[object], str | None]


def at_least(low: float) -> Check:
    return lambda v: None if v >= low else f"must be >= {low:g}"


def above(low: float) -> Check:
    return lambda v: None if v > low else f"must be > {low:g}"


def one_of(*allowed: object) -> Check:
    shown = ", ".join("null" if a is None else str(a) for a in allowed)
    return lambda v: None if v in allowed else f"allowed values are {shown}"


def kv_backend(v: str) -> str | None:
    """A built-in KV backend, or ``package.module:attribute`` naming a Transport elsewhere."""
    module, _, attr = v.partition(":")
    if v in KV_BACKENDS or (module and attr and all(p.isidentifier() for p in module.split("."))):
        return None
    return f"allowed values are {', '.join(KV_BACKENDS)}, or 'package.module:attribute'"


def tcp_port(v: int) -> str | None:
    return None if 0 <= v <= 65535 else "must be a TCP port in [0, 65535] (0: any free port)"


def seconds(v: float) -> str | None:
    return None if 0 < v < float("inf") else "must be a positive finite number of seconds"


def in_unit(v: float) -> str | None:
    return None if 0 < v <= 1 else "must be in (0, 1]"


def spec(default=None, check: Check | None = None, help: str = "", factory=None):
    """A dataclass field with a default (or factory), a value check and a one-line help."""
    meta = {"check": check, "help": help}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class Resources:
    num_cpus: float = spec(1.0, at_least(0), "CPUs per instance (torch threads follow it)")
    num_gpus: float = spec(0.0, at_least(0), "GPUs per instance (> 0 runs it on CUDA)")
    custom: dict[str, float] = spec(
        None,
        ray_resources,
        "Ray custom resources each rank takes, {name: amount} (ray start --resources)",
        factory=dict,
    )


@dataclass
class Speculative:
    method: str | None = spec(
        None,
        one_of(None, "ngram", "suffix"),
        "speculative decoding: null (off), ngram (prompt lookup) or suffix (suffix decoding "
        "over the request's and recent requests' tokens); engine/guessers.py",
    )
    num_tokens: int = spec(2, at_least(1), "guessed tokens one decode step verifies")


@dataclass
class PoolConfig:
    """One pool of identical engine instances: ``prefill``, ``decode`` or ``colocated``."""

    instances: int = spec(1, at_least(0), "engine instances in the pool")
    tensor_parallel: int = spec(1, at_least(1), "tensor-parallel degree of each instance")
    max_batch_tokens: int = spec(512, at_least(1), "token budget of one engine step")
    max_batch_size: int = spec(64, at_least(1), "requests in one running batch")
    mixed_prefill_tokens: int | None = spec(
        None,
        at_least(1),
        "prompt tokens a step may carry beside running decodes (null: what max_batch_tokens "
        "leaves): bounds how far a prompt stretches the decodes' steps",
    )
    kv_blocks: int = spec(2048, at_least(1), "paged KV cache blocks per instance")
    block_size: int = spec(16, at_least(1), "tokens per KV block")
    prefix_caching: bool = spec(
        True, None, "reuse the KV of cached full blocks of shared prompt prefixes"
    )
    resources: Resources = spec(factory=Resources)
    speculative: Speculative = spec(factory=Speculative)
    node_labels: dict[str, str] = spec(
        None,
        ray_labels,
        "Ray node labels every rank's node must carry, {key: value} (ray start --labels)",
        factory=dict,
    )
    bind: str | None = spec(
        None,
        None,
        "interface this pool's workers listen on (KV receivers, gloo pairs, tensor-parallel "
        "stores); null: 127.0.0.1 with an embedded Ray, else the node's Ray address",
    )
    advertise: str | None = spec(
        None, None, "address peers are told; null: bind (a wildcard bind: the node's)"
    )
    metrics_port: int | None = spec(
        None,
        tcp_port,
        "port each instance serves its own Prometheus metrics on, at bind (0: any free "
        "port; null: none); the router lists them at GET /metrics/targets",
    )

    def engine_config(self, dtype: str, attention_backend: str | None, device: str) -> dict:
        """Keyword arguments of ``engine.EngineConfig`` for one instance of this pool."""
        return dict(
            dtype=dtype,
            block_size=self.block_size,
            num_kv_blocks=self.kv_blocks,
            max_batch_tokens=self.max_batch_tokens,
            max_batch_size=self.max_batch_size,
            mixed_prefill_tokens=self.mixed_prefill_tokens,
            enable_prefix_caching=self.prefix_caching,
            speculative_tokens=self.speculative.num_tokens if self.speculative.method else 0,
            speculative_method=self.speculative.method or "ngram",
            attention_backend=attention_backend,
            device=device,
        )


def readable_file(v: str) -> str | None:
    """The path of a file this process can read."""
    path = os.path.expanduser(v)
    if os.path.isfile(path) and os.access(path, os.R_OK):
        return None
    return "must be the path of a readable file"


@dataclass
class RayTLSConfig:
    """Ray's own TLS (``RAY_USE_TLS``), set in the driver's environment before it connects
    to an existing Ray; every node of that Ray must run with the same settings."""

    cert_file: str | None = spec(None, readable_file, "RAY_TLS_SERVER_CERT (null: TLS off)")
    key_file: str | None = spec(None, readable_file, "RAY_TLS_SERVER_KEY")
    ca_file: str | None = spec(None, readable_file, "RAY_TLS_CA_CERT")


@dataclass
class RayConfig:
    address: str | None = spec(
        None, None, 'null: an embedded local Ray; "auto" or "ray://host:10001": an existing one'
    )
    num_cpus: float | None = spec(
        None, above(0), "CPUs the embedded local Ray offers (default: the machine's)"
    )
    tls: RayTLSConfig = spec(factory=RayTLSConfig)
    insecure: bool = spec(
        False, None, "allow an existing Ray off loopback with neither TLS nor token auth"
    )


@dataclass
class RouterTLSConfig:
    """TLS on both router ports (gRPC and HTTP); with it the ports speak TLS only."""

    cert_file: str | None = spec(None, readable_file, "PEM certificate chain (null: TLS off)")
    key_file: str | None = spec(None, readable_file, "PEM private key of cert_file")
    client_ca_file: str | None = spec(
        None, readable_file, "PEM CAs a client certificate must chain to (null: no mTLS)"
    )


@dataclass
class RouterConfig:
    host: str = spec("127.0.0.1", None, "address the gRPC server binds")
    port: int = spec(50051, tcp_port, "gRPC port (0: any free port)")
    http_port: int = spec(8000, tcp_port, "OpenAI-compatible HTTP port (0: any free port)")
    policy: str = spec("least_loaded", one_of(*POLICIES), "routing policy")
    replicas: int = spec(
        1, at_least(1), "router processes on the same ports (SO_REUSEPORT), the bounds split"
    )
    max_queue: int = spec(1024, at_least(0), "requests waiting for an instance before refusal")
    max_expected_ttft_s: float | None = spec(
        None,
        seconds,
        "refuse on arrival a request expected to wait longer for its first token (null: off)",
    )
    queue_timeout_s: float = spec(
        60.0, seconds, "a request still waiting for an instance this long after arrival is refused"
    )
    max_concurrent_requests: int = spec(
        4096, at_least(1), "generate calls served at once over gRPC and HTTP; past it: refused"
    )
    drain_timeout_s: float = spec(30.0, at_least(0), "how long shutdown waits for requests")
    migration_limit: int = spec(
        2, at_least(0), "times a request moves to another instance when its instance dies"
    )
    stall_timeout_s: float = spec(
        180.0,
        seconds,
        "a placed request that makes no progress this long (no token, no handoff step, no "
        "instance to continue on after a migration) ends with an error naming what it "
        "waited for; above the supervisor's slowest detection (step_timeout_s) + migration",
    )
    api_key_file: str | None = spec(
        None, readable_file, "file of API keys, one a line (null: no authentication)"
    )
    tls: RouterTLSConfig = spec(factory=RouterTLSConfig)
    insecure: bool = spec(
        False, None, "allow a host off loopback with neither API keys nor mTLS (trusted network)"
    )
    max_concurrent_requests_per_key: int | None = spec(
        None, at_least(1), "generate calls one API key may have in progress (null: no bound)"
    )
    max_concurrent_requests_per_address: int | None = spec(
        1024,
        at_least(1),
        "without API keys: generate calls one client address may have in progress (null: no bound)",
    )
    header_timeout_s: float = spec(
        60.0,
        seconds,
        "HTTP: a request's headers must be in this long after its connection opened or its "
        "previous response ended (an idle kept-alive connection is closed after it)",
    )
    body_timeout_s: float = spec(
        60.0, seconds, "HTTP: a generate request's body must be in this long after its headers"
    )
    write_timeout_s: float = spec(
        60.0,
        seconds,
        "a streamed response (HTTP or gRPC) whose client takes nothing of it this long is ended",
    )
    max_request_id_chars: int = spec(256, at_least(1), "characters in a client's request_id")
    heartbeat_s: float = spec(
        1.0, seconds, "how often the launching process pings each router replica"
    )
    unresponsive_s: float = spec(
        5.0,
        seconds,
        "a router replica that answers no ping this long is hung: killed, and restarted "
        "on the same ports",
    )
    rejoin_grace_s: float = spec(
        30.0,
        at_least(0),
        "instances keep the requests of a router whose feed ended this long for it to come "
        "back (0: dropped at once)",
    )
    resume_retention_s: float = spec(
        60.0,
        seconds,
        "a request a restarted router rebuilt, or one that finished unread, is kept this "
        "long for its client to resume it",
    )
    max_body_bytes: int = spec(8 * 2**20, at_least(1024), "largest HTTP request body")
    max_message_bytes: int = spec(8 * 2**20, at_least(1024), "largest gRPC message, each way")
    max_prompt_tokens: int | None = spec(
        None, at_least(1), "prompt tokens of one request (null: the model's context)"
    )
    max_stop_strings: int = spec(16, at_least(0), "stop strings in one request")
    max_stop_string_chars: int = spec(256, at_least(1), "characters in one stop string")
    max_grammar_bytes: int = spec(
        65536, at_least(1), "UTF-8 bytes of one request's structured-output schema or grammar"
    )
    prefill_ms_per_token: float = spec(
        1.0,
        above(0),
        "hybrid mode: a prompt token's prefill cost until the instances' steps measure it",
    )
    transfer_mb_per_s: float = spec(
        1000.0,
        above(0),
        "hybrid mode: KV transfer throughput until finished handoffs measure it",
    )
    tokenizer_threads: int = spec(
        2, at_least(1), "threads that tokenize and render chat templates, off the event loop"
    )


@dataclass
class SupervisorConfig:
    """How the supervisor (cluster/supervisor.py) tells a failed instance and restarts it."""

    heartbeat_s: float = spec(1.0, seconds, "how often every process of every instance is pinged")
    unresponsive_s: float = spec(
        10.0, seconds, "a process that answers no ping this long is hung (SIGSTOP, a lost host)"
    )
    step_timeout_s: float = spec(
        120.0, seconds, "an engine step running this long is stuck (a collective lost its peer)"
    )
    max_restarts: int = spec(
        10, at_least(0), "restarts of one instance before it is left failed (0: never restarted)"
    )
    placement_timeout_s: float = spec(
        60.0,
        seconds,
        "an instance's placement group not placed this long fails its start (no node offers "
        "its pool's resources and labels)",
    )
    adopt_timeout_s: float = spec(
        60.0,
        seconds,
        "a restarted supervisor's adoption of the running instances: a call that needs them "
        "(workers, handles) waits this long, then fails naming this key",
    )


@dataclass
class KVTransferTLSConfig:
    """mTLS on the grpc KV backend (kv_transfer/grpc_tls.py): every prefill and decode
    worker presents cert_file and requires its peer's certificate to chain to ca_file."""

    cert_file: str | None = spec(
        None,
        readable_file,
        "PEM certificate chain, naming every pool's advertise address (null: no TLS)",
    )
    key_file: str | None = spec(None, readable_file, "PEM private key of cert_file")
    ca_file: str | None = spec(None, readable_file, "PEM CAs a peer's certificate must chain to")


@dataclass
class KVTransferConfig:
    backend: str = spec("gloo", kv_backend, "KV transport between pools")
    layerwise: bool = spec(True, None, "send KV layer by layer as the last chunk runs")
    lease_s: float = spec(30.0, above(0), "seconds a KV transfer may make no progress")
    checksum: bool = spec(False, None, "checksum every transferred chunk (receiver verifies)")
    secret_file: str | None = spec(
        None,
        None,
        "file holding the secret that KV peers prove (at least 16 bytes); null: a new one "
        "per launch. Set it when pools of separate launches send KV to each other",
    )
    tls: KVTransferTLSConfig = spec(factory=KVTransferTLSConfig)


@dataclass
class SLOConfig:
    ttft_ms: float = spec(1000.0, above(0), "time-to-first-token objective")
    tpot_ms: float = spec(150.0, above(0), "time-per-output-token objective")
    attainment: float = spec(0.9, in_unit, "share of requests that must meet both")


@dataclass
class LoggingConfig:
    """The log lines of the router and the CLI (docs/serving.md, "Metrics and logs")."""

    format: str = spec("text", one_of(*LOG_FORMATS), "text, or json: one JSON object a line")
    level: str = spec("INFO", one_of(*LOG_LEVELS), "the least severe level logged")


def _model_check(v: str) -> str | None:
    return None if v.strip() else "must name a model: an alias, a HF folder or a .gguf file"


@dataclass
class ClusterConfig:
    model: str = spec(None, _model_check, "alias (smollm2-135m), HF folder or .gguf file")
    mode: str = spec(
        "colocated",
        one_of(*MODES),
        "placement: co-located, disaggregated pools, or hybrid (disaggregated pools whose "
        "decode instances also prefill a request when that is sooner)",
    )
    dtype: str = spec("float32", one_of(*DTYPES), "weights and KV cache dtype")
    attention_backend: str | None = spec(
        None, one_of(None, *BACKENDS), "engine attention backend (null: by device)"
    )
    ray: RayConfig = spec(factory=RayConfig)
    router: RouterConfig = spec(factory=RouterConfig)
    prefill: PoolConfig = spec(factory=PoolConfig)
    decode: PoolConfig = spec(factory=PoolConfig)
    colocated: PoolConfig = spec(factory=lambda: PoolConfig(instances=2))
    kv_transfer: KVTransferConfig = spec(factory=KVTransferConfig)
    supervisor: SupervisorConfig = spec(factory=SupervisorConfig)
    slo: SLOConfig = spec(factory=SLOConfig)
    logging: LoggingConfig = spec(factory=LoggingConfig)

    REQUIRED = ("model",)

    def pools(self) -> dict[str, PoolConfig]:
        """The pools this mode runs, by role name."""
        if self.mode == "colocated":
            return {"colocated": self.colocated}
        return {"prefill": self.prefill, "decode": self.decode}

    def to_dict(self) -> dict:
        return asdict(self)
