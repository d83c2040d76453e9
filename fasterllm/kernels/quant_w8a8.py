"""W8A8 GEMM: int8 activations x int8 weights -> int32 sums -> * row scale * column scale (+ bias).

FasterLLaMA's INT8 path: activations quantized per token (kernels/quant_activation.py), weights per output
channel; the tensor cores sum int8 products exactly in int32, and the dequantization is an epilogue. Three ways,
chosen from H100 measurements (benchmarks/RESULTS.md):
  decode (M <= DECODE_MAX_ROWS) on NVIDIA Hopper, N a multiple of 64: decode_gemm.py's GEMM (K split on narrow
      projections, the epilogue inside on wide ones)
  other decode rows: cuBLAS's int8 GEMM (torch._int_mm, which needs more than 16 rows: fewer are padded with zero
      rows), its int32 [M, N] scaled by quant_split_k's epilogue kernel (one small launch)
  prefill: a Triton GEMM, 128x128 tiles grouped along M for L2 reuse, the scales and bias in its own epilogue
      so the int32 result never goes to memory (1.1-1.6x bf16 at 512 rows, where torch._int_mm is 1.0-1.25x)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fasterllm.cpu_features import cpu_features
from fasterllm.kernels.decode_gemm import MAX_ROWS, decode_gemm, decode_gemm_plan
from fasterllm.kernels.dependent_launch import early_launch, early_start
from fasterllm.kernels.quant_split_k import epilogue, reduce_splits

DECODE_MAX_ROWS = MAX_ROWS  # up to here decode_gemm or cuBLAS, above the Triton GEMM
_INT_MM_MIN_ROWS = 17  # torch._int_mm on CUDA needs M > 16
_BLOCK = 128  # M, N and K tile of the Triton GEMM: one program per output tile, all of K
_GROUP_M = 8


@triton.jit(do_not_specialize=["M"])  # any row count, one compiled variant (see quant_weight_only.py)
def _int8_gemm_kernel(a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, bias_ptr, out_ptr, M, N, K, stride_am, stride_bn,
                      HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      GROUP_M: tl.constexpr, PDL: tl.constexpr):
    early_start(PDL)
    # consecutive programs share B columns across GROUP_M row tiles (L2 reuse)
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * tiles_n)
    first_m = group * GROUP_M
    size_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * tiles_n)) % size_m
    pid_n = (pid % (GROUP_M * tiles_n)) // size_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = rm < M, rn < N
    a_rows = a_ptr + rm[:, None].to(tl.int64) * stride_am
    b_cols = b_ptr + rn[None, :].to(tl.int64) * stride_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_mask = kk < K
        a = tl.load(a_rows + kk[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0)
        b = tl.load(b_cols + kk[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0)
        acc = tl.dot(a, b, acc, out_dtype=tl.int32)
    out = epilogue(acc, rm, rn, M, N, a_scale_ptr, b_scale_ptr, bias_ptr, True, True, HAS_BIAS)
    tl.store(out_ptr + rm[:, None].to(tl.int64) * N + rn[None, :], out.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def int8_gemm(a: torch.Tensor, a_scales: torch.Tensor, b: torch.Tensor, b_scales: torch.Tensor,
              bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """a int8 [M, K] (row scales fp32 [M] or [M, 1]) x b int8 [N, K] (column scales fp32 [N]) -> [M, N] out_dtype:
    (a @ b^T) * a_scales[m] * b_scales[n] + bias[n]."""
    m, k = a.shape
    n = b.shape[0]
    if a.dtype != torch.int8 or b.dtype != torch.int8 or b.shape[1] != k or a.stride(-1) != 1 or b.stride(-1) != 1:
        raise ValueError(f"int8_gemm needs int8 a [M, K] and b [N, K] with contiguous rows; got a {tuple(a.shape)} "
                         f"{a.dtype}, b {tuple(b.shape)} {b.dtype}")
    if a_scales.numel() != m or b_scales.numel() != n or not (a_scales.is_contiguous() and b_scales.is_contiguous()):
        raise ValueError(f"scales must be contiguous, one value per row of a ({m}) and of b ({n}); got "
                         f"{a_scales.numel()} and {b_scales.numel()}")
    plan = decode_gemm_plan(m, n, k, a.device)
    if plan is not None and a.is_contiguous() and b.is_contiguous():
        return decode_gemm(a, a_scales, b, b_scales, bias, out_dtype, plan)
    out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if m == 0:
        return out
    # torch._int_mm's shapes: multiples of 8 (in the interpreter on a CPU only where its sums are exact: cpu_features)
    if m <= DECODE_MAX_ROWS and k % 8 == 0 and n % 8 == 0 and (a.is_cuda or cpu_features().exact_int8_matmul):
        padded = a if m >= _INT_MM_MIN_ROWS else torch.cat([a, a.new_zeros(_INT_MM_MIN_ROWS - m, k)])
        sums = torch._int_mm(padded, b.t())[:m]  # [M, N] int32, the first rows of a contiguous tensor
        return reduce_splits(sums.unsqueeze(0), out, a_scales, b_scales, bias)
    grid = (triton.cdiv(m, _BLOCK) * triton.cdiv(n, _BLOCK),)
    _int8_gemm_kernel[grid](a, a_scales, b, b_scales, bias if bias is not None else out, out, m, n, k, a.stride(0),
                            b.stride(0), HAS_BIAS=bias is not None, BLOCK_M=_BLOCK, BLOCK_N=_BLOCK, BLOCK_K=_BLOCK,
                            GROUP_M=_GROUP_M, num_warps=8, num_stages=3, **early_launch(a.device))
    return out


def int8_gemm_reference(a: torch.Tensor, a_scales: torch.Tensor, b: torch.Tensor, b_scales: torch.Tensor,
                        bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """The torch reference: exact integer sums (fp64 holds them exactly; CUDA has no int64 matmul), then the
    same fp32 epilogue."""
    acc = (a.double() @ b.double().t()).float()
    out = acc * a_scales.float().reshape(-1, 1) * b_scales.float().reshape(1, -1)
    return (out if bias is None else out + bias.float()).to(out_dtype)
