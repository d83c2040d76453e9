"""A random int4 weight in tinygemm's layout, for the tests of the Gluon int4 kernels (test_int4_gemv.py,
test_int4_mma.py)."""
from __future__ import annotations

import torch

from fasterllm.kernels.quant_weight_only import pack_int4_tinygemm, tinygemm_reference
from fasterllm.layers.quantization.int4 import scales_and_zeros


def int4_weight(n: int, k: int, group_size: int, device: torch.device, seed: int = 0):
    """(codes uint8 [N, K], pack_int4_tinygemm's words, bf16 scale_zeros [K/group, N, 2], the fp32 weight they stand
    for)."""
    torch.manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, device=device)
    scales = torch.rand(n, k // group_size, device=device) * 0.01
    zeros = torch.randn(n, k // group_size, device=device) * 0.05
    scale_zeros = scales_and_zeros(scales, zeros, torch.bfloat16)
    return codes, pack_int4_tinygemm(codes), scale_zeros, tinygemm_reference(codes, scale_zeros, group_size)
