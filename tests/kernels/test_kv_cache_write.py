import pytest
import torch
from paged_cases import DEVICE, DTYPES, dtype_id

from pdserve.kernels.kv_cache_write import ref_write_kv_cache, write_kv_cache


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("num_kv_heads", [1, 3, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
def test_matches_reference(block_size, head_dim, num_kv_heads, dtype):
    num_blocks, t = 6, 37
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size)[:t]
    slots = slots.to(DEVICE)
    # k, v as strided views of a fused [T, 2 * Hkv * D] projection.
    kv = torch.randn(t, 2, num_kv_heads, head_dim, dtype=dtype, device=DEVICE)
    k, v = kv[:, 0], kv[:, 1]
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    v_cache = torch.full_like(k_cache, float("nan"))
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    write_kv_cache(k, v, k_cache, v_cache, slots)
    ref_write_kv_cache(k, v, ref_k, ref_v, slots)
    torch.testing.assert_close(k_cache, ref_k, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, ref_v, rtol=0, atol=0, equal_nan=True)
    assert k_cache.isnan().sum() == (num_blocks * block_size - t) * num_kv_heads * head_dim


def test_rejects_bad_arguments():
    k = torch.randn(4, 2, 64, device=DEVICE)
    cache = torch.zeros(2, 16, 2, 64, device=DEVICE)
    slots = torch.arange(4, device=DEVICE)
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv_cache(k, k, cache, cache.clone(), slots.int())
    with pytest.raises(ValueError, match="k_cache"):
        write_kv_cache(k, k, cache[:, :, :1], cache[:, :, :1].clone(), slots)
    with pytest.raises(ValueError, match="v"):
        write_kv_cache(k, k.half(), cache, cache.clone(), slots)
