"""Argument checks shared by the launchers: each raises ValueError naming the argument."""

from __future__ import annotations

import torch


def check_like(ref_name: str, ref: torch.Tensor, **tensors: torch.Tensor) -> None:
    """Each tensor has ref's dtype and device and a contiguous last dimension."""
    for name, x in {ref_name: ref, **tensors}.items():
        if x.dtype != ref.dtype:
            raise ValueError(f"{name}: expected dtype {ref.dtype} ({ref_name}'s), got {x.dtype}")
        if x.device != ref.device:
            raise ValueError(f"{name}: expected device {ref.device} ({ref_name}'s), got {x.device}")
        if x.stride(-1) != 1:
            raise ValueError(f"{name}: expected a contiguous last dimension, got {x.stride()}")


def check_index(
    name: str, x: torch.Tensor, shape: tuple, dtype: torch.dtype, device: torch.device
) -> None:
    """x is an integer tensor of ``dtype`` on ``device`` with ``shape`` (None: any size)."""
    fits = x.dim() == len(shape) and all(
        s in (None, n) for s, n in zip(shape, x.shape, strict=True)
    )
    if not fits or x.dtype != dtype or x.device != device:
        want = ", ".join("?" if s is None else str(s) for s in shape)
        raise ValueError(
            f"{name}: expected [{want}] {dtype} on {device}, got {tuple(x.shape)} {x.dtype} "
            f"on {x.device}"
        )


def check_window(window, softcap) -> None:
    """window is None or an int >= 1 (a sliding window of that many tokens); softcap is
    None or a float > 0."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)):
        raise ValueError(f"window: expected None or an int >= 1, got {window!r}")
    if window is not None and window < 1:
        raise ValueError(f"window: expected None or an int >= 1, got {window}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap: expected None or a float > 0, got {softcap!r}")


def check_paged_attention(q, k_cache, v_cache, seq_lens, block_tables, out) -> None:
    """q [rows, Hq, D]; caches [num_blocks, block_size, Hkv dividing Hq, D]; seq_lens [B]
    and block_tables [B, max_blocks] int32; out shaped like q."""
    if q.dim() != 3:
        raise ValueError(f"q: expected [rows, num_q_heads, head_dim], got {tuple(q.shape)}")
    hq, d = q.shape[1:]
    if k_cache.dim() != 4 or k_cache.shape[3] != d or hq % k_cache.shape[2] != 0:
        raise ValueError(
            f"k_cache: expected [num_blocks, block_size, num_kv_heads dividing {hq}, {d}], "
            f"got {tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape:
        raise ValueError(
            f"v_cache: expected shape {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}"
        )
    if out.shape != q.shape:
        raise ValueError(f"out: expected shape {tuple(q.shape)}, got {tuple(out.shape)}")
    check_like("q", q, k_cache=k_cache, v_cache=v_cache, out=out)
    check_index("seq_lens", seq_lens, (None,), torch.int32, q.device)
    check_index("block_tables", block_tables, (seq_lens.shape[0], None), torch.int32, q.device)
    if block_tables.stride(1) != 1:
        raise ValueError("block_tables: expected contiguous rows")


def check_latent_decode(q_c, q_r, c_cache, r_cache, block_tables, seq_lens, out=None) -> None:
    """q_c [B, H, Dk], q_r [B, H, Dr]; c_cache [num_blocks, block_size, Hc dividing H,
    Dc >= Dk] and r_cache [num_blocks, block_size, Dr] (see paged_latent_decode.py);
    seq_lens [B] and block_tables [B, max_blocks] int32; out, if given, [B, H, Dc]."""
    if q_c.dim() != 3 or q_r.dim() != 3 or q_r.shape[:2] != q_c.shape[:2]:
        raise ValueError(
            f"q_c, q_r: expected [B, H, Dk] and [B, H, Dr] with the same B, H, got "
            f"{tuple(q_c.shape)} and {tuple(q_r.shape)}"
        )
    b, h, dk = q_c.shape
    if c_cache.dim() != 4 or h % c_cache.shape[2] != 0 or not 0 < dk <= c_cache.shape[3]:
        raise ValueError(
            f"c_cache: expected [num_blocks, block_size, Hc dividing {h}, Dc >= {dk}], "
            f"got {tuple(c_cache.shape)}"
        )
    if r_cache.shape != (*c_cache.shape[:2], q_r.shape[2]):
        raise ValueError(
            f"r_cache: expected [{c_cache.shape[0]}, {c_cache.shape[1]}, {q_r.shape[2]}] "
            f"(c_cache's blocks, q_r's Dr), got {tuple(r_cache.shape)}"
        )
    want_out = (b, h, c_cache.shape[3])
    if out is not None and out.shape != want_out:
        raise ValueError(f"out: expected shape {want_out}, got {tuple(out.shape)}")
    extra = {} if out is None else {"out": out}
    check_like("q_c", q_c, q_r=q_r, c_cache=c_cache, r_cache=r_cache, **extra)
    check_index("seq_lens", seq_lens, (b,), torch.int32, q_c.device)
    check_index("block_tables", block_tables, (b, None), torch.int32, q_c.device)
    if block_tables.stride(1) != 1:
        raise ValueError(f"block_tables: expected contiguous rows, got {block_tables.stride()}")
