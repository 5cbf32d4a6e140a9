"""On ``PYTHONPATH`` of vLLM's processes (bench/peers_offline.py, where pdserve is forced
to AVX2 on a CPU with AVX-512): torch reports no AVX-512, so vLLM loads its AVX2 kernel
build (vllm._C_AVX2) as it would on a CPU without AVX-512. Python imports this module at
start-up in every process, the engine processes vLLM spawns included."""

import torch.cpu

torch.cpu._is_avx512_supported = lambda: False
