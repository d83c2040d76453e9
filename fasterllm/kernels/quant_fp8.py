"""FP8 GEMM: e4m3 activations per token x e4m3 weights per channel -> (a @ b^T) * row scale * column scale (+ bias).

Two ways, chosen from H100 measurements (benchmarks/RESULTS.md): decode rows (up to 64) on NVIDIA Hopper through
decode_gemm.py's GEMM, which reads the weights faster than cuBLAS there; other rows through torch._scaled_mm's
row-wise scaling (Hopper's fp8 tensor cores through cuBLAS).
"""
from __future__ import annotations

import torch

from fasterllm.kernels.decode_gemm import decode_gemm, decode_gemm_plan


def fp8_gemm(a: torch.Tensor, a_scales: torch.Tensor, b: torch.Tensor, b_scales: torch.Tensor,
             bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """a e4m3 [M, K] (fp32 row scales [M, 1]) x b e4m3 [N, K] (fp32 column scales [1, N]; K and N multiples of 16,
    torch._scaled_mm's shapes) -> [M, N] out_dtype."""
    bias = None if bias is None else bias.to(out_dtype)
    plan = decode_gemm_plan(a.shape[0], b.shape[0], a.shape[1], a.device)
    if plan is not None and a.is_contiguous() and b.is_contiguous():  # as quant_w8a8.int8_gemm: else cuBLAS
        return decode_gemm(a, a_scales, b, b_scales, bias, out_dtype, plan)
    return torch._scaled_mm(a, b.t(), scale_a=a_scales, scale_b=b_scales, bias=bias, out_dtype=out_dtype)
