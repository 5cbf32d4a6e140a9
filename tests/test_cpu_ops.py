"""The C ops of ``TorchOps`` (float32 on CPU) against its plain-torch ops."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.cpu_ops import cpu_ops
from pdserve.engine.ops import TorchOps
from pdserve.engine.rope import rope_tables

# every test on each ISA the CPU has (tests/conftest.py isa)
pytestmark = pytest.mark.usefixtures("isa")
NATIVE, PLAIN = TorchOps(), TorchOps(use_kernel=False)


@pytest.mark.parametrize("tokens", [1, 7, 300])
@pytest.mark.parametrize("hidden", [64, 576, 100])
def test_rms_norms_match(tokens, hidden):
    x, residual, w = torch.randn(tokens, hidden), torch.randn(tokens, hidden), torch.randn(hidden)
    torch.testing.assert_close(NATIVE.rms_norm(x, w, 1e-5), PLAIN.rms_norm(x, w, 1e-5))
    normed, total = NATIVE.add_rms_norm(x, residual, w, 1e-6)
    ref_normed, ref_total = PLAIN.add_rms_norm(x, residual, w, 1e-6)
    torch.testing.assert_close(total, ref_total, rtol=0, atol=0)
    torch.testing.assert_close(normed, ref_normed)


@pytest.mark.parametrize("tokens", [1, 5, 700])
@pytest.mark.parametrize("heads", [(9, 3), (4, 4)])
@pytest.mark.parametrize("head_dim", [64, 32])
def test_rotary_matches_on_qkv_views(tokens, heads, head_dim):
    hq, hkv = heads
    cos, sin = rope_tables(head_dim, 4096, 10000.0, None)
    positions = torch.randint(0, 4096, (tokens,))
    qkv = torch.randn(tokens, (hq + 2 * hkv) * head_dim)

    def rotated(ops):
        q, k, v = qkv.clone().split([hq * head_dim, hkv * head_dim, hkv * head_dim], -1)
        rope = ops.rope(positions, cos, sin)
        return ops.rotary(q.view(tokens, hq, head_dim), k.view(tokens, hkv, head_dim), rope)

    for got, want in zip(rotated(NATIVE), rotated(PLAIN), strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("tokens", [1, 3, 257])
@pytest.mark.parametrize("inter", [1536, 40, 7])
def test_silu_and_mul_matches(tokens, inter):
    # tails past a multiple of 16 lanes, large gates of either sign (e^-g clamped)
    x = torch.randn(tokens, 2 * inter) * 4
    x[0, :2] = torch.tensor([-120.0, 95.0])
    torch.testing.assert_close(NATIVE.silu_and_mul(x), PLAIN.silu_and_mul(x))
    strided = torch.randn(tokens, 2 * inter + 5)[:, : 2 * inter]  # rows further apart
    torch.testing.assert_close(NATIVE.silu_and_mul(strided), PLAIN.silu_and_mul(strided))


@pytest.mark.parametrize("cols", [1, 15, 16, 17, 49152, 1000])
def test_argmax_is_torchs(cols):
    native = cpu_ops()
    x = torch.randn(9, cols)
    x[1] = 0.0  # all equal: the first
    x[2, cols // 2 :] = x[2].max() + 1  # equal maxima: the first of them
    x[3, cols - 1] = float("nan")  # a NaN wins
    x[4] = float("-inf")
    x[5, cols // 3] = float("inf")
    x[6, :: max(cols // 4, 1)] = float("nan")  # the first NaN
    assert torch.equal(native.argmax(x), x.argmax(-1))
    strided = torch.randn(5, cols + 7)[:, 3 : cols + 3]
    assert torch.equal(native.argmax(strided), strided.argmax(-1))


def test_unpacked_heads_fall_back_to_torch():
    cos, sin = rope_tables(64, 128, 10000.0, None)
    positions = torch.arange(3)
    x = torch.randn(3, 64, 4).transpose(1, 2)  # heads not packed: stride(2) != 1
    rope = NATIVE.rope(positions, cos, sin)
    got, _ = NATIVE.rotary(x.clone(), x.clone(), rope)
    want, _ = PLAIN.rotary(x.clone(), x.clone(), PLAIN.rope(positions, cos, sin))
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("cols", [1, 15, 16, 17, 33, 1000, 49152])
def test_masked_argmax_is_torchs_over_the_allowed_tokens(cols):
    """The sampler's guided greedy choice (engine/sampler.py): a packed bitmask row per
    picked logits row, against torch's argmax of the row with -inf where a bit is clear."""
    from pdserve.engine.sampler import _masked_row

    native, words = cpu_ops(), (cols + 31) // 32
    last = 1 << (cols - 1) % 32
    last = last if last < 2**31 else -(2**31)  # the last token's bit, as an int32
    x = torch.randn(8, cols)
    x[2] = 0.0  # all equal: the first allowed
    x[3, : cols // 2] = float("-inf")
    x[5, cols // 2] = x[5].max() + 5  # a large logit a sparse mask may forbid
    rows = [0, 2, 3, 5, 7, 5]
    bits = torch.randint(-(2**31), 2**31, (len(rows), words), dtype=torch.int32)
    bits[1, : words // 2] = 0  # the first half forbidden: the first allowed after it
    bits[2] = -1  # every token allowed, the first half -inf
    bits[3] = 0
    bits[3, -1] = last  # only the last token
    bits[4, words // 2 :] = 0
    if cols > 16:
        bits[5] &= 0x0000FFFF  # only the first 16 tokens of each word: whole blocks skipped
    got = native.masked_argmax(x, rows, bits)
    # torch's answer where something is allowed (the sampler never asks about a row
    # that allows nothing: it allows every token instead)
    masked = [_masked_row(x[r], bits[j]) for j, r in enumerate(rows)]
    none_allowed = [bool(torch.isneginf(m).all() and not torch.isneginf(x[r]).all())
                    for m, r in zip(masked, rows, strict=True)]  # fmt: skip
    want = [-1 if n else int(m.argmax()) for m, n in zip(masked, none_allowed, strict=True)]
    assert got == want
    # a row allowing nothing answers -1; one allowing only -inf logits, its first allowed
    x[0] = float("-inf")
    none, only = torch.zeros(1, words, dtype=torch.int32), torch.zeros(1, words, dtype=torch.int32)
    only[0, -1] = last
    assert native.masked_argmax(x, [1], none) == [-1]
    assert native.masked_argmax(x, [0], only) == [cols - 1]
