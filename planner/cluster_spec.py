"""A candidate placement: the pools of a co-located or disaggregated cluster, as the
simulator runs it and as ``pdserve up`` loads it (``to_config``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.planner.prefix import POLICIES


@dataclass(frozen=True)
class PoolSpec:
    instances: int = 1
    tp: int = 1
    max_batch_tokens: int = 512
    max_batch_size: int = 64
    kv_blocks: int | None = None  # None: as many as the device memory holds (cost model)
    block_size: int = 16
    prefix_caching: bool = True  # its instances reuse cached prefixes (given tokens)
    mixed_prefill_tokens: int | None = None  # prompt tokens beside decodes (None: no cap)

    @property
    def devices(self) -> int:
        return self.instances * self.tp

    def describe(self) -> str:
        return f"{self.instances}x tp{self.tp}"


@dataclass(frozen=True)
class ClusterSpec:
    mode: str = "disaggregated"  # or "colocated", "hybrid"
    prefill: PoolSpec = field(default_factory=PoolSpec)
    decode: PoolSpec = field(default_factory=PoolSpec)
    colocated: PoolSpec = field(default_factory=PoolSpec)
    layerwise: bool = True  # KV sent layer by layer during the last chunk
    exposed_transfer_s: float | None = None  # fixed transfer time past prefill, if known
    policy: str = "least_loaded"  # the router's: or cache_aware (planner.prefix)
    # hybrid: slo.tpot_ms, which bounds local prefill beside a running batch (the router's
    # prefill choice, router/prefill_choice.py); None: no bound
    tpot_ms: float | None = None

    def __post_init__(self):
        if self.mode not in ("colocated", "disaggregated", "hybrid"):
            raise ValueError(
                f"mode {self.mode!r}: allowed values are colocated, disaggregated, hybrid"
            )
        if self.policy not in POLICIES:
            raise ValueError(f"policy {self.policy!r}: allowed values are {', '.join(POLICIES)}")

    @property
    def devices(self) -> int:
        if self.mode == "colocated":
            return self.colocated.devices
        return self.prefill.devices + self.decode.devices

    def describe(self) -> str:
        if self.mode == "colocated":
            return f"colocated {self.colocated.describe()}"
        pools = f"prefill {self.prefill.describe()} + decode {self.decode.describe()}"
        return f"hybrid {pools}" if self.mode == "hybrid" else pools

    def to_config(
        self,
        model: str,
        *,
        gpu: bool,
        dtype: str = "bfloat16",
        slo: dict | None = None,
        backend: str | None = None,
    ) -> dict:
        """The YAML mapping of this placement (``cluster.load_config`` checks it)."""

        def pool(p: PoolSpec, kv_blocks: int) -> dict:
            resources = {"num_cpus": 1, "num_gpus": 1 if gpu else 0}
            return {
                "instances": p.instances,
                "tensor_parallel": p.tp,
                "max_batch_tokens": p.max_batch_tokens,
                "max_batch_size": p.max_batch_size,
                "kv_blocks": p.kv_blocks or kv_blocks,
                "block_size": p.block_size,
                "mixed_prefill_tokens": p.mixed_prefill_tokens,
                "resources": resources,
            }

        out: dict = {"model": model, "mode": self.mode, "dtype": dtype}
        if self.mode == "colocated":
            out["colocated"] = pool(self.colocated, 2048)
        else:
            out["prefill"] = pool(self.prefill, 512)
            out["decode"] = pool(self.decode, 2048)
            out["kv_transfer"] = {
                "backend": backend or ("nccl" if gpu else "gloo"),
                "layerwise": self.layerwise,
            }
        if slo:
            out["slo"] = slo
        return out


def from_cluster_config(config) -> ClusterSpec:
    """The placement of a checked ``cluster.config.ClusterConfig``."""

    def pool(p) -> PoolSpec:
        return PoolSpec(
            p.instances,
            p.tensor_parallel,
            p.max_batch_tokens,
            p.max_batch_size,
            p.kv_blocks,
            p.block_size,
            p.prefix_caching,
            p.mixed_prefill_tokens,
        )

    return ClusterSpec(
        config.mode,
        pool(config.prefill),
        pool(config.decode),
        pool(config.colocated),
        layerwise=config.kv_transfer.layerwise,
        policy=config.router.policy,
        tpot_ms=config.slo.tpot_ms,
    )
