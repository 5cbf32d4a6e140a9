"""The Triton attention backend and op set (CUDA; on CPU only in the Triton interpreter).

``TritonAttentionBackend.forward`` serves a batch (prefills first, then decodes)
with three launches: ``write_kv_cache`` for all T new tokens, then
``paged_prefill_attention`` over the prefill sequences' rows and
``paged_decode_attention`` over the decode rows, each writing its own slice of
one output tensor. Either attention launch is skipped when its half of the batch
is empty, and none of them syncs with the host: counts and maxima come from the
host lists of ``AttentionMetadata``.
"""

from __future__ import annotations

import torch

from pdserve.engine.attention.backend import AttentionBackend, AttentionMetadata
from pdserve.engine.ops import Ops
from pdserve.kernels.activation import silu_and_mul
from pdserve.kernels.kv_cache_write import write_kv_cache
from pdserve.kernels.paged_decode_attention import paged_decode_attention
from pdserve.kernels.paged_prefill_attention import paged_prefill_attention
from pdserve.kernels.rms_norm import add_rms_norm, rms_norm
from pdserve.kernels.rotary import rotary


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        p, p_rows = meta.num_prefills, meta.num_prefill_tokens
        if p:
            paged_prefill_attention(
                q[:p_rows],
                k_cache,
                v_cache,
                meta.query_start_loc[: p + 1],
                meta.seq_lens[:p],
                meta.block_tables[:p],
                scale,
                max_query_len=max(meta.query_lens_host[:p]),
                out=out[:p_rows],
                window=window,
                softcap=softcap,
            )
        if meta.num_decodes:
            paged_decode_attention(
                q[p_rows:],
                k_cache,
                v_cache,
                meta.seq_lens[p:],
                meta.block_tables[p:],
                scale,
                max_seq_len=max(meta.seq_lens_host[p:]),
                out=out[p_rows:],
                window=window,
                softcap=softcap,
            )
        return out


class TritonOps(Ops):
    def rms_norm(self, x, w, eps):
        return rms_norm(x, w, eps)

    def add_rms_norm(self, x, residual, w, eps):
        return add_rms_norm(x, residual, w, eps)

    def rope(self, positions, cos, sin):
        return positions, cos, sin

    def rotary(self, q, k, rope):
        return rotary(q, k, *rope)

    def silu_and_mul(self, x):
        return silu_and_mul(x)
