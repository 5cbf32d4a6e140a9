"""The tensor-parallel group of a model shard; every collective the engine uses lives here.

A tensor-parallel engine is its own torch.distributed world of ``size`` processes (gloo
on CPU, NCCL on GPU), made from an authenticated rendezvous that rank 0 serves
(``rendezvous/server.py``: every rank proves the cluster's secret, and rank 0 proves it
back, before the world's store is read or written): no process-wide default group, so
a process may also hold KV transfer groups (kv_transfer/) or belong to another world.
Rank 0 schedules and broadcasts each step (engine/step_plan.py); every rank runs the
forward pass on its shard.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass

import torch

from pdserve.rendezvous.client import RendezvousStore
from pdserve.rendezvous.server import RendezvousServer

TIMEOUT = datetime.timedelta(minutes=30)  # an idle rank waits this long for the next step
POLL_S = 0.1  # how often a rank tries to reach a rendezvous that does not listen yet


@dataclass(frozen=True)
class TensorParallel:
    """Rank ``rank`` of ``size``; ``group`` is the process group (None when size is 1)."""

    rank: int = 0
    size: int = 1
    group: object | None = None
    device: str = "cpu"  # where collectives' tensors live (NCCL: this rank's GPU)

    def shard(self, total: int, what: str) -> tuple[int, int]:
        """The [start, end) slice of ``total`` units this rank owns."""
        if total % self.size:
            raise ValueError(
                f"{what}={total} is not divisible by tensor_parallel={self.size}: "
                f"each rank must hold {what} / tensor_parallel of them"
            )
        per = total // self.size
        return self.rank * per, (self.rank + 1) * per

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place."""
        if self.size > 1:
            self.group.allreduce([x]).wait()
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` concatenated along the last dim, in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.group.allgather([parts], [x.contiguous()]).wait()
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """``src``'s ``x`` on every rank (same shape and dtype everywhere), in place."""
        if self.size > 1:
            self.group.broadcast(x, src).wait()
        return x

    @classmethod
    def join(
        cls, address: str, rank: int, size: int, secret: bytes, device: str = "cpu"
    ) -> TensorParallel:
        """Rank ``rank`` of the world whose store (``serve_store``, with the same
        ``secret``) is at ``address``; rank 0 may start serving it after the others
        started joining (within ``TIMEOUT``)."""
        if size == 1:
            return SINGLE
        host, port = address.rsplit(":", 1)
        deadline = time.monotonic() + TIMEOUT.total_seconds()
        while True:
            try:
                store = RendezvousStore(host.strip("[]"), int(port), secret, TIMEOUT)
                break
            except ConnectionRefusedError:  # rank 0 does not listen yet
                if time.monotonic() > deadline:
                    raise
                time.sleep(POLL_S)
        store.set(f"up/{rank}", "1")  # rank 0 waits for these, watching the processes
        if device == "cuda":
            device = f"cuda:{torch.cuda.current_device()}"
        return cls(rank, size, _group(store, rank, size, host, device), device)


def check_degree(cfg, size: int, where: str = "tensor_parallel") -> None:
    """Raise unless a model of shape ``cfg`` (``ModelConfig``) splits over ``size`` ranks
    (an MLA latent is replicated, so only its query heads and MLP split)."""
    kv = () if cfg.mla is not None and cfg.mla.replicated else ("num_kv_heads",)
    for what in ("num_heads", *kv, "intermediate_size"):
        total = getattr(cfg, what)
        if total % size:
            raise ValueError(
                f"{where}={size}: the model's {what}={total} is not divisible by {size}; "
                f"allowed degrees divide {cfg.num_heads} heads, {cfg.num_kv_heads} KV heads "
                f"and the MLP width {cfg.intermediate_size}"
            )


def serve_store(
    secret: bytes, bind: str = "127.0.0.1", port: int = 0, advertise: str | None = None
) -> tuple[RendezvousServer, str]:
    """The rendezvous of a new world (kept alive by the caller; its ``store`` holds
    the world's keys), listening on ``bind`` only for peers that prove ``secret``, and
    its ``advertise:port`` (``advertise`` None: ``bind``)."""
    server = RendezvousServer(bind, port, secret)
    return server, f"{advertise or bind}:{server.port}"


def _group(store, rank: int, size: int, host: str, device: str):
    prefix = torch.distributed.PrefixStore("tp", store)
    if device == "cuda":
        from torch.distributed import ProcessGroupNCCL

        opts = ProcessGroupNCCL.Options()
        opts._timeout = TIMEOUT
        return ProcessGroupNCCL(prefix, rank, size, opts)
    from torch.distributed import ProcessGroupGloo

    opts = ProcessGroupGloo._Options()
    opts._devices = [ProcessGroupGloo.create_device(hostname=host)]
    opts._timeout = TIMEOUT
    return ProcessGroupGloo(prefix, rank, size, opts)


SINGLE = TensorParallel()
