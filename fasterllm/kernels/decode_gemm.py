"""W8A8 / FP8 GEMM for decode rows (up to 64) on Hopper: per-token quantized activations [M, K] (int8 or e4m3) x
per-channel quantized weights [N, K] of the same type, the dequantization (row scale, column scale, bias, cast) in
an epilogue.

cuBLAS (torch._scaled_mm, torch._int_mm) leaves most of an H100 idle where N gives few output tiles: Llama-3-8B's
down_proj at 16-64 rows read 1.3-1.4 TB/s. Here K is split so that about two programs run per SM; the per-split
fp32 / int32 sums land in a workspace and quant_split_k's epilogue kernel adds them in a fixed order. Where the
output tiles fill the GPU unsplit (gate_up_proj), each program applies the epilogue itself and the sums never go to
memory (at 64 rows: 52-53 us, where cuBLAS took 56-58; benchmarks/RESULTS.md). The plan is a function of the shape
only, so a decode CUDA graph replays the same launches.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fasterllm.kernels.dependent_launch import early_launch, early_start
from fasterllm.kernels.quant_split_k import SplitKPlan, epilogue, nvidia_capability, plan_split_k, reduce_splits

MAX_ROWS = 64  # one BLOCK_M tile of rows
_BLOCK_N, _BLOCK_K = 64, 256
_PROGRAMS_PER_SM = 2
# fewer K tiles a split leave the pipeline short and add partial sums to reduce: o_proj's 16 tiles at 16-64 rows took
# 13.5-14.0 us in 4 splits and 12.1-12.6 us in 2 (H100)
_MIN_K_BLOCKS = 8


@triton.jit(do_not_specialize=["M"])  # any row count, one compiled variant
def _decode_gemm_kernel(a_ptr, b_ptr, out_ptr, row_scale_ptr, col_scale_ptr, bias_ptr, M, N, K, k_per_split,
                        SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """SPLIT: this program's K range -> fp32 / int32 partial sums at out_ptr [splits, M, N]; else all of K -> the
    epilogue's output at out_ptr [M, N]."""
    early_start(PDL)
    IS_INT: tl.constexpr = a_ptr.dtype.element_ty == tl.int8
    pid_n, split = tl.program_id(0), tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = split * k_per_split
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32 if IS_INT else tl.float32)
    for k0 in range(k_start, tl.minimum(K, k_start + k_per_split), BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        a_mask = (rm < M)[:, None] if EVEN_K else (rm < M)[:, None] & (rk < K)[None, :]
        a = tl.load(a_ptr + rm[:, None] * K + rk[None, :], mask=a_mask, other=0.0)
        b_ptrs = b_ptr + rn[None, :].to(tl.int64) * K + rk[:, None]  # [BLOCK_K, BLOCK_N]: W^T, K-major
        if EVEN_K:
            b = tl.load(b_ptrs, eviction_policy="evict_first")  # every weight byte is read once
        else:
            b = tl.load(b_ptrs, mask=(rk < K)[:, None], other=0.0, eviction_policy="evict_first")
        if IS_INT:  # int8 products add exactly in int32
            acc = tl.dot(a, b, acc, out_dtype=tl.int32)
        else:
            # Hopper's fp8 MMA adds into fewer bits than fp32: promote each tile's sums into the fp32 accumulator,
            # as cuBLAS does (left to the MMA across all of K, the error grew 1.2-1.5x against torch._scaled_mm's)
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)
    mask = (rm < M)[:, None]
    if SPLIT:
        tl.store(out_ptr + split * M * N + rm[:, None] * N + rn[None, :], acc, mask=mask)
    else:
        out = epilogue(acc, rm, rn, M, N, row_scale_ptr, col_scale_ptr, bias_ptr, True, True, HAS_BIAS)
        tl.store(out_ptr + rm[:, None] * N + rn[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


def _runs_decode_gemm(device: torch.device) -> bool:
    """The kernel's tiles and pipeline are sized and measured on NVIDIA Hopper (other GPUs, ROCm's included, keep
    cuBLAS); a CPU device is Triton's interpreter."""
    return device.type == "cpu" or (nvidia_capability(device) or (0, 0))[0] == 9


def decode_gemm_plan(m: int, n: int, k: int, device: torch.device) -> SplitKPlan | None:
    """quant_split_k's plan for this shape (64x64x256 tiles, about _PROGRAMS_PER_SM programs per SM, at least
    _MIN_K_BLOCKS tiles of K a split; one split where the output tiles fill the GPU), or None where cuBLAS runs
    instead: more than MAX_ROWS rows, N the tiles do not divide, or a GPU other than NVIDIA Hopper."""
    if not 1 <= m <= MAX_ROWS or n % _BLOCK_N or not _runs_decode_gemm(device):
        return None
    return plan_split_k(m, n, k, MAX_ROWS, _BLOCK_N, _BLOCK_K, _PROGRAMS_PER_SM, device, _MIN_K_BLOCKS)


def decode_gemm(a: torch.Tensor, a_scales: torch.Tensor, b: torch.Tensor, b_scales: torch.Tensor,
                bias: torch.Tensor | None, out_dtype: torch.dtype, plan: SplitKPlan) -> torch.Tensor:
    """a [M, K] (row scales fp32, M of them) x b [N, K] (column scales fp32, N of them), both int8 or both e4m3 with
    contiguous rows, -> [M, N] out_dtype = (a @ b^T) * a_scales[m] * b_scales[n] + bias[n], with decode_gemm_plan's
    plan."""
    m, k = a.shape
    n = b.shape[0]
    if a.dtype != b.dtype or a.dtype not in (torch.int8, torch.float8_e4m3fn):
        raise ValueError(f"decode_gemm multiplies int8 by int8 or e4m3 by e4m3; got {a.dtype} and {b.dtype}")
    if b.shape[1] != k or not a.is_contiguous() or not b.is_contiguous():
        raise ValueError(f"decode_gemm needs contiguous a [M, K] and b [N, K]; got a {tuple(a.shape)}, "
                         f"b {tuple(b.shape)}")
    if a_scales.numel() != m or b_scales.numel() != n or not (a_scales.is_contiguous() and b_scales.is_contiguous()):
        raise ValueError(f"scales must be contiguous, one value per row of a ({m}) and of b ({n}); got "
                         f"{a_scales.numel()} and {b_scales.numel()}")
    if (plan.block_m, plan.block_n, plan.block_k) != (MAX_ROWS, _BLOCK_N, _BLOCK_K) or not 1 <= m <= MAX_ROWS \
            or n % _BLOCK_N or plan.k_per_split % _BLOCK_K or plan.splits * plan.k_per_split < k:
        raise ValueError(f"the plan {plan} does not fit a [{m}, {k}] x [{n}, {k}] product: at most {MAX_ROWS} rows, "
                         f"N a multiple of {_BLOCK_N}, splits of whole {_BLOCK_K}-wide K tiles covering K; take the "
                         "plan from decode_gemm_plan")
    out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    sums = plan.partial_sums(out, torch.int32 if a.dtype == torch.int8 else torch.float32)
    split = sums is not out
    _decode_gemm_kernel[(n // _BLOCK_N, plan.splits)](
        a, b, sums, a_scales, b_scales, bias if bias is not None else out, m, n, k, plan.k_per_split, SPLIT=split,
        HAS_BIAS=bias is not None, EVEN_K=k % _BLOCK_K == 0, BLOCK_M=MAX_ROWS, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K,
        num_warps=4, num_stages=3, **early_launch(a.device))
    return reduce_splits(sums, out, a_scales, b_scales, bias) if split else out
