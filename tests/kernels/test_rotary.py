import pytest
import torch
from paged_cases import DEVICE, DTYPES, TOLERANCES, dtype_id, layout_id

from pdserve.kernels.rotary import ref_rotary, rotary


def _cos_sin(max_pos, head_dim, theta=10000.0):
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    return angles.cos().to(DEVICE), angles.sin().to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (5, 1)], ids=layout_id)
@pytest.mark.parametrize("head_dim", [64, 128, 80])
def test_matches_reference(head_dim, heads, dtype):
    hq, hkv = heads
    t = 9
    cos, sin = _cos_sin(512, head_dim)
    positions = torch.randint(0, 512, (t,), device=DEVICE)
    # q and k as strided views of a fused qkv projection.
    qkv = torch.randn(t, hq + 2 * hkv, head_dim, dtype=dtype, device=DEVICE)
    q, k = qkv[:, :hq], qkv[:, hq : hq + hkv]
    out_q, out_k = rotary(q, k, positions, cos, sin)
    ref_q, ref_k = ref_rotary(q, k, positions, cos, sin)
    torch.testing.assert_close(out_q, ref_q, **TOLERANCES[dtype])
    torch.testing.assert_close(out_k, ref_k, **TOLERANCES[dtype])


def test_rejects_bad_arguments():
    cos, sin = _cos_sin(16, 64)
    q, k = torch.randn(3, 4, 64, device=DEVICE), torch.randn(3, 2, 64, device=DEVICE)
    positions = torch.arange(3, device=DEVICE)
    with pytest.raises(ValueError, match="positions"):
        rotary(q, k, positions.int(), cos, sin)
    with pytest.raises(ValueError, match="cos"):
        rotary(q, k, positions, cos.half(), sin)
    with pytest.raises(ValueError, match="k"):
        rotary(q, k[:, :, :32], positions, cos, sin)
