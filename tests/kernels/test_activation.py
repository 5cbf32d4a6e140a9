import pytest
import torch
from paged_cases import DEVICE, DTYPES, TOLERANCES, dtype_id

from pdserve.kernels.activation import ref_silu_and_mul, silu_and_mul


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("inter", [1, 100, 1500])
@pytest.mark.parametrize("tokens", [1, 6])
def test_matches_reference(tokens, inter, dtype):
    x = torch.randn(tokens, 2 * inter, dtype=dtype, device=DEVICE) * 4
    torch.testing.assert_close(silu_and_mul(x), ref_silu_and_mul(x), **TOLERANCES[dtype])


def test_rejects_odd_width():
    with pytest.raises(ValueError, match="x"):
        silu_and_mul(torch.randn(2, 7, device=DEVICE))
