"""Decode attention time per KV layout on this CPU: one layer, one tensor-parallel rank's
share of the heads, batch 1 and 32 at contexts 1k and 8k (the second part of
``python -m pdserve.bench.kv_bytes``).

- MHA / GQA: the engine's decode step, ``TorchAttentionBackend.forward`` on a decode-only
  batch (the new token's K/V written, then attention over the paged cache), float32:
  the C kernel (``engine/attention/cpu_decode.c``, built by ``engine/native.py`` with
  ``-march=native``) where it is built, else torch SDPA over the gathered blocks.
- MLA / GTA / GLA: issue 22's absorbed decode op, ``paged_latent_decode(q_c, q_r,
  c_cache, r_cache, block_tables, seq_lens, scale)`` over strided views of one latent
  cache, float32: the first of ``LATENT_OPS`` (the engine's C kernel, its torch op, the
  kernels package's reference) that this tree has and that takes the inputs; until one
  is merged these rows say the op is not built.
Caches are filled with a constant (the time does not depend on the values); a cell whose
cache passes ``max_cache_mib`` is skipped. Times are the median of 3 after a warm-up;
"GB/s of KV" is the float32 cache read over that time.
"""

from __future__ import annotations

import importlib
import statistics
import time

import torch

from pdserve.engine.attention.backend import AttentionMetadata
from pdserve.engine.attention.cpu_kernel import DecodeKernel, decode_kernel
from pdserve.engine.attention.torch_backend import TorchAttentionBackend
from pdserve.planner.model_shape import ModelShape

BLOCK_SIZE = 16
BATCHES = (1, 32)
CONTEXTS = (1024, 8192)


def cpu_isa() -> str:
    """What this CPU offers the kernels: torch's dispatch level and the flags the
    ``-march=native`` build of ``engine/native.py`` compiles for."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next(
                (line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []
            )
    except OSError:
        flags = []
    have = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if f in flags]
    return f"torch {torch.backends.cpu.get_cpu_capability()}, flags {' '.join(have) or 'none'}"


def decode_path(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> str:
    """Which decode path ``TorchAttentionBackend`` takes for these tensors."""
    if DecodeKernel.supports(q, k_cache, v_cache) and decode_kernel() is not None:
        return "C kernel engine/attention/cpu_decode.c"
    return "torch SDPA over gathered blocks"


# issue 22's CPU latent decode ops, the engine's first: (path, module, function). The C
# kernel returns None for inputs it does not take; the next one then runs.
LATENT_OPS = (
    (
        "C kernel engine/attention/cpu_latent.c",
        "pdserve.engine.attention.cpu_latent",
        "paged_latent_decode",
    ),
    (
        "torch engine/attention/latent_torch.py",
        "pdserve.engine.attention.latent_torch",
        "paged_latent_decode",
    ),
    (
        "torch kernels/paged_latent_decode.py ref",
        "pdserve.kernels.paged_latent_decode",
        "ref_paged_latent_decode",
    ),
)


def latent_decode_ops() -> list[tuple[str, object]]:
    """(path, fn) of the ``LATENT_OPS`` this tree has; empty until they are merged."""
    ops = []
    for path, module, name in LATENT_OPS:
        try:
            ops.append((path, getattr(importlib.import_module(module), name)))
        except ImportError:
            continue
    return ops


def _tables(batch: int, context: int) -> tuple[torch.Tensor, int]:
    """Shuffled block tables [batch, blocks] int32 and the number of blocks in all."""
    per = -(-context // BLOCK_SIZE)
    ids = torch.randperm(batch * per, generator=torch.Generator().manual_seed(0))
    return ids.view(batch, per).to(torch.int32), batch * per


def _median_ms(fn, reps: int = 3) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def time_grouped(heads: int, kv_heads: int, head_dim: int, batch: int, context: int):
    """(ms, path) of one decode step of ``batch`` sequences of ``context`` tokens."""
    tables, blocks = _tables(batch, context)
    shape = (blocks, BLOCK_SIZE, kv_heads, head_dim)
    k_cache, v_cache = torch.full(shape, 0.01), torch.full(shape, 0.01)
    q = torch.full((batch, heads, head_dim), 0.01)
    k = v = torch.full((batch, kv_heads, head_dim), 0.01)
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    last = tables[:, (context - 1) // BLOCK_SIZE].long()
    meta = AttentionMetadata(
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32),
        seq_lens=seq_lens,
        block_tables=tables,
        slot_mapping=last * BLOCK_SIZE + (context - 1) % BLOCK_SIZE,
        num_decodes=batch,
        max_query_len=1,
        max_seq_len=context,
        query_lens_host=[1] * batch,
        seq_lens_host=[context] * batch,
    )
    backend, scale = TorchAttentionBackend(), head_dim**-0.5
    ms = _median_ms(lambda: backend.forward(q, k, v, k_cache, v_cache, meta, scale))
    return ms, decode_path(q, k_cache, v_cache)


def time_latent(ops, heads: int, hc: int, dc: int, dk: int, dr: int, batch: int, context: int):
    """(ms, path) of one absorbed decode step over a [blocks, block_size, hc * dc + dr]
    cache by the first of ``ops`` that takes these inputs."""
    tables, blocks = _tables(batch, context)
    latent = torch.full((blocks, BLOCK_SIZE, hc * dc + dr), 0.01)
    c_cache, r_cache = latent[..., : hc * dc].unflatten(-1, (hc, dc)), latent[..., hc * dc :]
    q_c, q_r = torch.full((batch, heads, dk), 0.01), torch.full((batch, heads, dr), 0.01)
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    args = (q_c, q_r, c_cache, r_cache, tables, seq_lens, (dk + dr) ** -0.5)
    for path, op in ops:
        if op(*args) is not None:
            return _median_ms(lambda op=op: op(*args)), path
    raise ValueError(f"no latent decode op takes these inputs: {[p for p, _ in ops]}")


def rank_dims(shape: ModelShape, tp: int) -> dict:
    """One rank's share: query heads and its KV heads (or latent heads and widths)."""
    heads = shape.num_heads // tp
    if shape.latent is None:
        return dict(heads=heads, kv_heads=shape.num_kv_heads // tp, head_dim=shape.head_dim)
    lat = shape.latent
    return dict(heads=heads, hc=lat.local_heads(tp), dc=lat.dim, dk=lat.key_dim, dr=lat.rope_dim)


def cache_mib(dims: dict, batch: int, context: int) -> float:
    """float32 cache MiB one cell allocates."""
    blocks = batch * -(-context // BLOCK_SIZE)
    if "kv_heads" in dims:
        row = 2 * dims["kv_heads"] * dims["head_dim"]
    else:
        row = dims["hc"] * dims["dc"] + dims["dr"]
    return blocks * BLOCK_SIZE * row * 4 / 2**20


def report(variants, tp: int, max_cache_mib: float, threads: int = 1) -> list[str]:
    """The timing table, one line per (variant, batch, context), on ``threads`` torch
    threads (1 by default: on a shared machine a second thread's barrier waits on a
    busy core and measures the neighbours)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _report(variants, tp, max_cache_mib)
    finally:
        torch.set_num_threads(before)


def _report(variants, tp: int, max_cache_mib: float) -> list[str]:
    ops = latent_decode_ops()
    lines = [
        f"decode attention, one layer, one rank's share at TP {tp} (or the largest degree "
        f"that shards its latent heads), float32, {torch.get_num_threads()} threads; CPU: "
        f"{cpu_isa()}",
        f"latent ops: {', '.join(p for p, _ in ops) or 'not built (none of LATENT_OPS here)'}",
        "| variant | TP | batch | context | cache MiB | ms | GB/s of KV | path |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for v in variants:
        rank_tp = max(v.shape.tp_degrees(tp))
        dims = rank_dims(v.shape, rank_tp)
        for batch in BATCHES:
            for context in CONTEXTS:
                mib = cache_mib(dims, batch, context)
                cell = f"| {v.name} | {rank_tp} | {batch} | {context} | {mib:,.0f} |"
                if mib > max_cache_mib:
                    lines.append(f"{cell} - | - | skipped (over {max_cache_mib} MiB) |")
                    continue
                if "kv_heads" in dims:
                    ms, path = time_grouped(batch=batch, context=context, **dims)
                elif not ops:
                    lines.append(f"{cell} - | - | latent op not built |")
                    continue
                else:
                    ms, path = time_latent(ops, batch=batch, context=context, **dims)
                gbs = mib * 2**20 / (ms / 1000) / 1e9
                lines.append(f"{cell} {ms:.2f} | {gbs:.1f} | {path} |")
    return lines
