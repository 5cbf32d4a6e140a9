"""The KV transfer's view of one rank's cache (``LLMEngine.kv_view``, ``RankEngine.kv_view``).

Senders read the blocks of a request's table; receivers write the blocks of a
reservation (engine/reservation.py); both through the tensors named here. The view
changes no bookkeeping: which blocks a request holds is the scheduler's and the block
manager's business, reached only through ``LLMEngine``'s methods.
"""

from __future__ import annotations

import torch

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.model_runner import ModelRunner


class KVView:
    """Read-only: every attribute is fixed at construction (the tensors' contents change
    with each step and transfer, never their shape or storage)."""

    __slots__ = ("_blocks", "_runner")

    def __init__(self, runner: ModelRunner, blocks: BlockManager):
        self._runner, self._blocks = runner, blocks

    @property
    def cache(self) -> torch.Tensor:
        """The whole cache, one allocation: ``[layers, 2 (k, v), blocks, block size, kv
        heads, head dim]``, or ``[layers, blocks, block size, row width]`` for a latent
        (MLA) layout."""
        return self._runner.kv_cache

    @property
    def layers(self) -> list:
        """Per layer: its ``(k, v)`` views of ``cache``, or its latent rows' view."""
        return self._runner.kv_caches

    @property
    def block_size(self) -> int:
        return self._blocks.block_size

    @property
    def num_blocks(self) -> int:
        return self._blocks.num_blocks

    @property
    def bytes_per_token(self) -> int:
        """This rank's cache bytes per token, all layers (MLA: the replicated latent row)."""
        return self._runner.kv_bytes_per_token

    def block_table(self, request_id: str) -> tuple[int, ...]:
        """The blocks ``request_id`` holds, in token order (a hand-off request that left,
        its KV being sent, keeps its table until ``LLMEngine.release``); empty when it
        holds none."""
        return tuple(self._blocks.block_table(request_id))
