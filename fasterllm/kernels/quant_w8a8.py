"""W8A8 GEMM (Triton): int8 activations x int8 weights -> int32 sums -> * row scale * column scale (+ bias).

FasterLLaMA's INT8 path: activations quantized per token (kernels/quant_activation.py), weights per output
channel; the tensor cores sum int8 products exactly in int32 and the dequantization is this kernel's epilogue,
so the int32 result never goes to memory. Any number of rows: decode (M <= 64) splits K across programs
(quant_split_k.py; int32 partials add exactly), prefill uses 128x128 tiles grouped along M for L2 reuse
(torch._int_mm is not used: it needs M > 16 and writes int32 out before a separate epilogue).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fasterllm.kernels.quant_split_k import epilogue, plan_split_k, reduce_splits

SPLIT_K_MAX_ROWS = 64
_LARGE_BLOCK = 128  # M, N and K tile above SPLIT_K_MAX_ROWS rows: one program per output tile, all of K
_GROUP_M = 8


@triton.jit
def _int8_gemm_kernel(a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, bias_ptr, out_ptr, M, N, K, stride_am, stride_bn,
                      K_PER_SPLIT: tl.constexpr, DIRECT: tl.constexpr, HAS_BIAS: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid_k = tl.program_id(1)
    if GROUP_M > 1:  # consecutive programs share B columns across GROUP_M row tiles (L2 reuse)
        pid = tl.program_id(0)
        tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
        group = pid // (GROUP_M * tiles_n)
        first_m = group * GROUP_M
        size_m = tl.minimum(tiles_m - first_m, GROUP_M)
        pid_m = first_m + (pid % (GROUP_M * tiles_n)) % size_m
        pid_n = (pid % (GROUP_M * tiles_n)) // size_m
    else:
        pid_n, pid_m = tl.program_id(0), tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = rm < M, rn < N
    a_rows = a_ptr + rm[:, None].to(tl.int64) * stride_am
    b_cols = b_ptr + rn[None, :].to(tl.int64) * stride_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    k_start = pid_k * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K) if K_PER_SPLIT > 0 else K
    for k0 in range(k_start, k_end, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_mask = kk < K
        a = tl.load(a_rows + kk[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0)
        b = tl.load(b_cols + kk[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0)
        acc = tl.dot(a, b, acc, out_dtype=tl.int32)
    offsets = rm[:, None].to(tl.int64) * N + rn[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    if DIRECT:
        out = epilogue(acc, rm, rn, M, N, a_scale_ptr, b_scale_ptr, bias_ptr, True, True, HAS_BIAS)
        tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptr + pid_k * M * N + offsets, acc, mask=mask)


def int8_gemm(a: torch.Tensor, a_scales: torch.Tensor, b: torch.Tensor, b_scales: torch.Tensor,
              bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """a int8 [M, K] (row scales fp32 [M] or [M, 1]) x b int8 [N, K] (column scales fp32 [N]) -> [M, N] out_dtype:
    (a @ b^T) * a_scales[m] * b_scales[n] + bias[n]."""
    m, k = a.shape
    n = b.shape[0]
    if a.dtype != torch.int8 or b.dtype != torch.int8 or b.shape[1] != k or a.stride(-1) != 1 or b.stride(-1) != 1:
        raise ValueError(f"int8_gemm needs int8 a [M, K] and b [N, K] with contiguous rows; got a {tuple(a.shape)} "
                         f"{a.dtype}, b {tuple(b.shape)} {b.dtype}")
    if a_scales.numel() != m or b_scales.numel() != n:
        raise ValueError(f"scales must hold one value per row of a ({m}) and of b ({n}); got {a_scales.numel()} "
                         f"and {b_scales.numel()}")
    out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if m == 0:
        return out
    bias_arg = bias if bias is not None else out
    if m > SPLIT_K_MAX_ROWS:
        grid = (triton.cdiv(m, _LARGE_BLOCK) * triton.cdiv(n, _LARGE_BLOCK), 1, 1)
        _int8_gemm_kernel[grid](a, a_scales, b, b_scales, bias_arg, out, m, n, k, a.stride(0), b.stride(0),
                                K_PER_SPLIT=0, DIRECT=True, HAS_BIAS=bias is not None, BLOCK_M=_LARGE_BLOCK,
                                BLOCK_N=_LARGE_BLOCK, BLOCK_K=_LARGE_BLOCK, GROUP_M=_GROUP_M, num_warps=8,
                                num_stages=3)
        return out
    plan = plan_split_k(m, n, k, 64, 256, a.device)
    direct = plan.splits == 1
    target = out if direct else torch.empty(plan.splits, m, n, dtype=torch.int32, device=a.device)
    _int8_gemm_kernel[plan.grid(m, n)](a, a_scales, b, b_scales, bias_arg, target, m, n, k, a.stride(0), b.stride(0),
                                       K_PER_SPLIT=plan.k_per_split, DIRECT=direct, HAS_BIAS=bias is not None,
                                       BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, GROUP_M=1,
                                       num_warps=4, num_stages=4)
    return out if direct else reduce_splits(target, out, a_scales, b_scales, bias)


def int8_gemm_reference(a: torch.Tensor, a_scales: torch.Tensor, b: torch.Tensor, b_scales: torch.Tensor,
                        bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """The torch reference: exact integer sums (fp64 holds them exactly; CUDA has no int64 matmul), then the
    same fp32 epilogue."""
    acc = (a.double() @ b.double().t()).float()
    out = acc * a_scales.float().reshape(-1, 1) * b_scales.float().reshape(1, -1)
    return (out if bias is None else out + bias.float()).to(out_dtype)
