"""The tensor-parallel group of a model shard; every collective the model uses lives here."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TensorParallel:
    """Rank ``rank`` of ``size``; ``group`` is the torch.distributed group (None when size is 1)."""

    rank: int = 0
    size: int = 1
    group: object | None = None

    def shard(self, total: int, what: str) -> tuple[int, int]:
        """The [start, end) slice of ``total`` units this rank owns."""
        if total % self.size:
            raise ValueError(f"{what}={total} is not divisible by tensor_parallel={self.size}")
        per = total // self.size
        return self.rank * per, (self.rank + 1) * per

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        import torch.distributed as dist

        dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


SINGLE = TensorParallel()
