import pytest
import torch
from paged_cases import DEVICE, DTYPES, TOLERANCES, dtype_id

from pdserve.kernels.rms_norm import add_rms_norm, ref_add_rms_norm, ref_rms_norm, rms_norm


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("hidden", [64, 100, 2048])
@pytest.mark.parametrize("tokens", [1, 7])
def test_rms_norm(tokens, hidden, dtype):
    x = torch.randn(tokens, hidden, dtype=dtype, device=DEVICE) * 3
    w = torch.randn(hidden, dtype=dtype, device=DEVICE)
    torch.testing.assert_close(rms_norm(x, w, 1e-6), ref_rms_norm(x, w, 1e-6), **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("hidden", [64, 100, 2048])
@pytest.mark.parametrize("tokens", [1, 7])
def test_add_rms_norm(tokens, hidden, dtype):
    x = torch.randn(tokens, hidden, dtype=dtype, device=DEVICE)
    residual = torch.randn(tokens, hidden, dtype=dtype, device=DEVICE) * 4
    w = torch.randn(hidden, dtype=dtype, device=DEVICE)
    x_before, residual_before = x.clone(), residual.clone()
    normed, new_residual = add_rms_norm(x, residual, w, 1e-5)
    ref_normed, ref_residual = ref_add_rms_norm(x, residual, w, 1e-5)
    torch.testing.assert_close(new_residual, ref_residual, rtol=0, atol=0)
    torch.testing.assert_close(normed, ref_normed, **TOLERANCES[dtype])
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


def test_per_head_norm_of_a_strided_view():
    """Qwen3-style q-norm: [T, H, D] normalized over D, from a view of a fused tensor."""
    qkv = torch.randn(5, 6, 64, device=DEVICE)
    q = qkv[:, :4]
    w = torch.randn(64, device=DEVICE)
    torch.testing.assert_close(rms_norm(q, w, 1e-6), ref_rms_norm(q, w, 1e-6))


def test_rejects_bad_arguments():
    x = torch.randn(3, 64, device=DEVICE)
    with pytest.raises(ValueError, match="x"):
        rms_norm(x, torch.ones(32, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        add_rms_norm(x, x.half(), torch.ones(64, device=DEVICE), 1e-6)
