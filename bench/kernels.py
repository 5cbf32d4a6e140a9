"""Triton kernel benchmark (GPU only): python -m pdserve.bench.kernels [--quick]

Each kernel is first checked against its ``ref_*`` on small random inputs (float16
and bfloat16), then timed at serving shapes against torch and, when installed,
FlashInfer (paged decode) and FlashAttention (varlen prefill). Decode attention
reports achieved bandwidth (K/V bytes read per second), prefill attention TFLOP/s,
the element-wise kernels bandwidth, each as a fraction of the device's measured
copy bandwidth or bf16 matmul peak. Goal: decode attention at 80% of copy bandwidth.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial

import torch

if __package__ in (None, ""):
    sys.exit(
        "bench/kernels.py: run it as a module from the repository root: "
        "python -m pdserve.bench.kernels"
    )
if not torch.cuda.is_available():
    sys.exit("bench/kernels.py needs a CUDA GPU (the kernels are checked on CPU by tests/kernels)")

import torch.nn.functional as F  # noqa: E402
from triton.testing import do_bench  # noqa: E402

import kernels as K  # noqa: E402

DEV = "cuda"
BF16 = torch.bfloat16
LAYOUTS = {"llama3-8b": (32, 8, 128), "smollm2-135m": (9, 3, 64)}  # (Hq, Hkv, D)
BLOCK = 16
DECODE_SHAPES = [(1, 32768), (8, 8192), (32, 4096), (64, 2048), (256, 512), (256, 2048)]
# (batch, chunk length, cached context before the chunk)
PREFILL_SHAPES = [(1, 8192, 0), (4, 2048, 0), (16, 512, 0), (1, 2048, 30720), (8, 512, 3584)]


def ms(fn) -> float:
    return do_bench(fn, warmup=10, rep=50, return_mode="median")


def report(label: str, work: float, peak: float, unit: str, candidates: dict) -> None:
    """Times each candidate; prints time and work/s as a fraction of ``peak``."""
    parts = []
    for name, fn in candidates.items():
        t = ms(fn) * 1e-3
        parts.append(
            f"{name} {t * 1e6:9.1f} us {work / t / 1e12:7.2f} {unit} {work / t / peak:4.0%}"
        )
    print(f"{label:40s} " + " | ".join(parts))


def device_peaks() -> tuple[float, float]:
    """(copy bandwidth in B/s counting read + write, bf16 matmul FLOP/s), both measured."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    bw = 2 * src.numel() / (ms(lambda: dst.copy_(src)) * 1e-3)
    a = torch.randn(8192, 8192, dtype=BF16, device=DEV)
    return bw, 2 * 8192**3 / (ms(lambda: a @ a) * 1e-3)


def paged(seq_lens, hkv, d, dtype):
    """Random caches and shuffled block tables for the given sequence lengths."""
    nblk = [-(-n // BLOCK) for n in seq_lens]
    k = torch.randn(sum(nblk) + 1, BLOCK, hkv, d, dtype=dtype, device=DEV)
    ids = torch.randperm(sum(nblk), device=DEV).int()
    tables = torch.zeros(len(seq_lens), max(nblk), dtype=torch.int32, device=DEV)
    for i, n in enumerate(nblk):
        tables[i, :n] = ids[sum(nblk[:i]) : sum(nblk[: i + 1])]
    return k, torch.randn_like(k), tables


def dense(cache, tables, n):
    """[B, Hkv, n, D] copy of equal-length paged sequences, for the dense baselines."""
    return cache[tables.long()].flatten(1, 2)[:, :n].transpose(1, 2).contiguous()


def check() -> None:
    tol = {"atol": 2e-2, "rtol": 2e-2}
    for dtype in (torch.float16, BF16):
        lens = [1, 15, 16, 17, 300, 5000]
        k, v, tables = paged(lens, 2, 128, dtype)
        lens_t = torch.tensor(lens, dtype=torch.int32, device=DEV)
        q = torch.randn(len(lens), 8, 128, dtype=dtype, device=DEV)
        args = (q, k, v, lens_t, tables, 0.088)
        torch.testing.assert_close(
            K.paged_decode_attention(*args), K.ref_paged_decode_attention(*args), **tol
        )
        qlens = torch.tensor([1, 15, 17, 300, 200])
        qsl = torch.tensor([0, *qlens.cumsum(0)], dtype=torch.int32, device=DEV)
        q = torch.randn(int(qlens.sum()), 8, 128, dtype=dtype, device=DEV)
        args = (q, k, v, qsl, lens_t[1:], tables[1:], 0.088)
        torch.testing.assert_close(
            K.paged_prefill_attention(*args), K.ref_paged_prefill_attention(*args), **tol
        )
        x, r = torch.randn(2, 37, 4096, dtype=dtype, device=DEV)
        w = torch.rand(4096, dtype=dtype, device=DEV)
        torch.testing.assert_close(K.rms_norm(x, w, 1e-5), K.ref_rms_norm(x, w, 1e-5), **tol)
        torch.testing.assert_close(
            K.add_rms_norm(x, r, w, 1e-5), K.ref_add_rms_norm(x, r, w, 1e-5), **tol
        )
        torch.testing.assert_close(K.silu_and_mul(x), K.ref_silu_and_mul(x), **tol)
        cos, sin = torch.rand(2, 512, 64, device=DEV)
        rot = (x.view(37, 32, 128), r.view(37, 32, 128)[:, :8], torch.arange(37, device=DEV))
        torch.testing.assert_close(K.rotary(*rot, cos, sin), K.ref_rotary(*rot, cos, sin), **tol)
        caches = [torch.zeros_like(k) for _ in range(4)]
        slots = torch.randperm(k.shape[0] * BLOCK, device=DEV)[:37]
        new = torch.randn(2, 37, 2, 128, dtype=dtype, device=DEV)
        K.write_kv_cache(*new, *caches[:2], slots)
        K.ref_write_kv_cache(*new, *caches[2:], slots)
        assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    print("all kernels match their references (float16, bfloat16)")


def flashinfer_decode(q, k, v, tables, n, hkv):
    import flashinfer

    workspace = torch.empty(128 << 20, dtype=torch.uint8, device=DEV)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, kv_layout="NHD")
    b, hq, d = q.shape
    nblk = -(-n // BLOCK)
    indptr = torch.arange(0, b * nblk + 1, nblk, dtype=torch.int32, device=DEV)
    last = torch.full((b,), n - (nblk - 1) * BLOCK, dtype=torch.int32, device=DEV)
    indices = tables[:, :nblk].flatten()
    wrapper.plan(indptr, indices, last, hq, hkv, d, BLOCK, q_data_type=BF16, kv_data_type=BF16)
    return lambda: wrapper.run(q, (k, v))


def decode_case(name, hq, hkv, d, b, n, bw) -> None:
    k, v, tables = paged([n] * b, hkv, d, BF16)
    lens = torch.full((b,), n, dtype=torch.int32, device=DEV)
    q = torch.randn(b, hq, d, dtype=BF16, device=DEV)
    kd, vd = dense(k, tables, n), dense(v, tables, n)
    candidates = {
        "triton": lambda: K.paged_decode_attention(q, k, v, lens, tables, d**-0.5, n),
        "sdpa(dense)": lambda: F.scaled_dot_product_attention(
            q.unsqueeze(2), kd, vd, enable_gqa=True
        ),
    }
    try:
        candidates["flashinfer"] = flashinfer_decode(q, k, v, tables, n, hkv)
    except Exception as e:  # an optional baseline must not stop the benchmark
        print(f"  flashinfer skipped: {type(e).__name__}: {e}"[:120])
    nbytes = 2 * b * n * hkv * d * 2 + 2 * q.numel() * 2
    report(f"{name} B={b} ctx={n}", nbytes, bw, "TB/s", candidates)


def prefill_case(name, hq, hkv, d, b, c, ctx, peak) -> None:
    n = ctx + c
    k, v, tables = paged([n] * b, hkv, d, BF16)
    lens = torch.full((b,), n, dtype=torch.int32, device=DEV)
    qsl = torch.arange(0, b * c + 1, c, dtype=torch.int32, device=DEV)
    q = torch.randn(b * c, hq, d, dtype=BF16, device=DEV)
    qd = q.view(b, c, hq, d).transpose(1, 2)
    kd, vd = dense(k, tables, n), dense(v, tables, n)
    mask = None if ctx == 0 else torch.ones(c, n, dtype=torch.bool, device=DEV).tril(ctx)
    candidates = {
        "triton": lambda: K.paged_prefill_attention(q, k, v, qsl, lens, tables, d**-0.5, c),
        "sdpa(dense)": lambda: F.scaled_dot_product_attention(
            qd, kd, vd, attn_mask=mask, is_causal=mask is None, enable_gqa=True
        ),
    }
    try:
        from flash_attn import flash_attn_varlen_func

        kf, vf = kd.transpose(1, 2).flatten(0, 1), vd.transpose(1, 2).flatten(0, 1)
        ksl = torch.arange(0, b * n + 1, n, dtype=torch.int32, device=DEV)
        candidates["flash_attn(dense)"] = lambda: flash_attn_varlen_func(
            q, kf, vf, qsl, ksl, c, n, causal=True
        )
    except ImportError:
        pass
    flops = 4 * b * hq * d * (c * ctx + c * (c + 1) // 2)
    report(f"{name} B={b} chunk={c} ctx={ctx}", flops, peak, "TFLOP/s", candidates)


def elementwise(bw) -> None:
    t, h, inter = 4096, 4096, 14336
    x, r = torch.randn(2, t, h, dtype=BF16, device=DEV)
    w = torch.rand(h, dtype=BF16, device=DEV)
    gate_up = torch.randn(t, 2 * inter, dtype=BF16, device=DEV)
    qkv = torch.randn(t, 48, 128, dtype=BF16, device=DEV)
    rot = (qkv[:, :32], qkv[:, 32:40], torch.randint(0, 8192, (t,), device=DEV))
    cos, sin = torch.rand(2, 8192, 64, device=DEV)
    cache = torch.empty(t // BLOCK, BLOCK, 8, 128, dtype=BF16, device=DEV)
    kv = (rot[1], rot[1], cache, cache, torch.randperm(t, device=DEV))
    cases = {
        "add_rms_norm": (K.add_rms_norm, K.ref_add_rms_norm, (x, r, w, 1e-5), 5 * t * h * 2),
        "silu_and_mul": (K.silu_and_mul, K.ref_silu_and_mul, (gate_up,), 3 * t * inter * 2),
        "rotary": (K.rotary, K.ref_rotary, (*rot, cos, sin), 2 * t * 40 * 128 * 2),
        "write_kv_cache": (K.write_kv_cache, K.ref_write_kv_cache, kv, 4 * t * 8 * 128 * 2),
    }
    for name, (fn, ref, args, nbytes) in cases.items():
        report(
            name, nbytes, bw, "TB/s", {"triton": partial(fn, *args), "torch": partial(ref, *args)}
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="check correctness only")
    args = parser.parse_args()
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), "| torch", torch.__version__)
    check()
    if args.quick:
        return
    bw, peak = device_peaks()
    print(f"measured: copy {bw / 1e12:.2f} TB/s, bf16 matmul {peak / 1e12:.0f} TFLOP/s")
    print("\ndecode attention, bf16, block 16: bandwidth as a fraction of copy bandwidth")
    for name, (hq, hkv, d) in LAYOUTS.items():
        for b, n in DECODE_SHAPES:
            decode_case(name, hq, hkv, d, b, n, bw)
    print("\nprefill attention, bf16, causal: FLOP/s as a fraction of bf16 matmul peak")
    for name, (hq, hkv, d) in LAYOUTS.items():
        for b, c, ctx in PREFILL_SHAPES:
            prefill_case(name, hq, hkv, d, b, c, ctx, peak)
    print("\nelement-wise kernels, bf16, 4096 tokens of Llama-3-8B: fraction of copy bandwidth")
    elementwise(bw)


if __name__ == "__main__":
    main()
