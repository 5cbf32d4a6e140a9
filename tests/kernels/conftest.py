"""Kernel tests: in the Triton interpreter on CPU tensors, or compiled on CUDA.

TRITON_INTERPRET must be set before any ``@triton.jit`` function is defined, so it
is set here, at import time, before the test modules import ``kernels``. On a GPU
machine the same tests run compiled on CUDA tensors, bfloat16 included.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _fresh_seed():
    """Fresh random inputs on every run; the seed is printed for a failing test."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"torch seed {seed}")
    torch.manual_seed(seed)
