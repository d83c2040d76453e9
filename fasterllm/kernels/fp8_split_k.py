"""FP8 GEMM for decode rows on narrow projections: e4m3 activations [M, K] x e4m3 weights [N, K], K split across
programs, the per-split fp32 sums reduced and scaled by quant_split_k's epilogue (row scale, column scale, bias).

torch._scaled_mm (cuBLAS) streams a wide weight well at a few rows, but where N gives few output tiles (o_proj,
down_proj of Llama-3-8B: 64 tiles of 64 columns for 132 SMs) it leaves most of the GPU idle: down_proj at 16-64
rows read 1.3-1.4 TB/s on an H100. Splitting K so that about two programs run per SM reads the same bytes with
every SM busy (benchmarks/RESULTS.md). The split count is a function of the shape only, so a decode CUDA graph
replays the same launches.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fasterllm.kernels.quant_split_k import SplitKPlan, plan_split_k, reduce_splits

MAX_ROWS = 64  # one BLOCK_M tile of rows
_BLOCK_N, _BLOCK_K = 64, 256
_PROGRAMS_PER_SM = 2


@triton.jit(do_not_specialize=["M"])  # any row count, one compiled variant
def _fp8_split_k_kernel(a_ptr, b_ptr, partial_ptr, M, N, K, k_per_split, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n, split = tl.program_id(0), tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = split * k_per_split
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, tl.minimum(K, k_start + k_per_split), BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        a_mask = (rm < M)[:, None] if EVEN_K else (rm < M)[:, None] & (rk < K)[None, :]
        a = tl.load(a_ptr + rm[:, None] * K + rk[None, :], mask=a_mask, other=0.0)
        b_ptrs = b_ptr + rn[None, :].to(tl.int64) * K + rk[:, None]  # [BLOCK_K, BLOCK_N]: W^T, K-major
        if EVEN_K:
            b = tl.load(b_ptrs, eviction_policy="evict_first")  # every weight byte is read once
        else:
            b = tl.load(b_ptrs, mask=(rk < K)[:, None], other=0.0, eviction_policy="evict_first")
        # Hopper's fp8 MMA adds into fewer bits than fp32: promote each tile's sums into the fp32 accumulator, as
        # cuBLAS does (left to the MMA across all of K, the error grew 1.2-1.5x against torch._scaled_mm's)
        acc = tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)
    offsets = split * M * N + rm[:, None] * N + rn[None, :]
    tl.store(partial_ptr + offsets, acc, mask=(rm < M)[:, None])


def split_k_plan(m: int, n: int, k: int, device: torch.device) -> SplitKPlan | None:
    """quant_split_k's plan for this shape (64x64x256 tiles, about _PROGRAMS_PER_SM programs per SM), or None where
    cuBLAS is the better choice: more than MAX_ROWS rows, N the tiles do not divide, or N wide enough to fill the
    GPU without splitting K."""
    if not 1 <= m <= MAX_ROWS or n % _BLOCK_N:
        return None
    plan = plan_split_k(m, n, k, MAX_ROWS, _BLOCK_N, _BLOCK_K, _PROGRAMS_PER_SM, device)
    return plan if plan.splits > 1 else None


def fp8_split_k_gemm(a: torch.Tensor, a_scales: torch.Tensor, b: torch.Tensor, b_scales: torch.Tensor,
                     bias: torch.Tensor | None, out_dtype: torch.dtype, plan: SplitKPlan) -> torch.Tensor:
    """a e4m3 [M, K] (row scales fp32, M of them) x b e4m3 [N, K] (column scales fp32, N of them), both with
    contiguous rows, -> [M, N] out_dtype = (a @ b^T) * a_scales[m] * b_scales[n] + bias[n], with split_k_plan's
    plan."""
    m, k = a.shape
    n = b.shape[0]
    if b.shape[1] != k or not a.is_contiguous() or not b.is_contiguous():
        raise ValueError(f"fp8_split_k_gemm needs contiguous a [M, K] and b [N, K]; got a {tuple(a.shape)}, "
                         f"b {tuple(b.shape)}")
    if a_scales.numel() != m or b_scales.numel() != n or not (a_scales.is_contiguous() and b_scales.is_contiguous()):
        raise ValueError(f"scales must be contiguous, one value per row of a ({m}) and of b ({n}); got "
                         f"{a_scales.numel()} and {b_scales.numel()}")
    if (plan.block_m, plan.block_n, plan.block_k) != (MAX_ROWS, _BLOCK_N, _BLOCK_K) or not 1 <= m <= MAX_ROWS \
            or n % _BLOCK_N or plan.splits * plan.k_per_split < k:
        raise ValueError(f"the plan {plan} does not fit a [{m}, {k}] x [{n}, {k}] product: at most {MAX_ROWS} rows, "
                         f"N a multiple of {_BLOCK_N}; take the plan from split_k_plan")
    partials = torch.empty(plan.splits, m, n, dtype=torch.float32, device=a.device)
    _fp8_split_k_kernel[(n // _BLOCK_N, plan.splits)](
        a, b, partials, m, n, k, plan.k_per_split, EVEN_K=k % _BLOCK_K == 0, BLOCK_M=MAX_ROWS, BLOCK_N=_BLOCK_N,
        BLOCK_K=_BLOCK_K, num_warps=4, num_stages=3)
    out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    return reduce_splits(partials, out, a_scales, b_scales, bias)
