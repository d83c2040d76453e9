"""The quantized decode matmuls' launch plan (Triton: the weight-only kernels, decode_gemm.py): a split of K for the
tiles the caller picks, from shapes only; and the epilogue kernel every quantized matmul shares (W8A8 applies it to
torch._int_mm's int32 sums off Hopper); and the device facts the quantized kernels choose by (SM count, NVIDIA
compute capability), each asked once per device.

Decode multiplies a few rows by a large weight: with one program per output tile, 4096 output columns make 64
programs, half an H100. Splitting K across programs gives every SM several programs streaming weights at
once; the partial sums land in a workspace [splits, M, N] (fp32, or int32 for int8 x int8) and one small
kernel adds them in a fixed order (deterministic, so a CUDA graph replay gives the eager result bit for bit) and
applies the epilogue (per-row scales, per-column scales, bias, cast). Everything depends on shapes alone: no host
sync, nothing data-dependent, so the launches are capturable.
"""
from __future__ import annotations

import functools

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fasterllm.kernels.dependent_launch import early_launch, early_start

_MAX_SPLITS = 16


@dataclass(frozen=True)
class SplitKPlan:
    block_m: int
    block_n: int
    block_k: int
    k_per_split: int  # a multiple of block_k
    splits: int

    def grid(self, m: int, n: int) -> tuple[int, int, int]:
        return triton.cdiv(n, self.block_n), self.splits, triton.cdiv(m, self.block_m)

    def partial_sums(self, out: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Where a launch of this plan writes: out itself for one split (its epilogue in the kernel), else a
        workspace [splits, M, N] of dtype that reduce_splits adds into out."""
        return out if self.splits == 1 else torch.empty(self.splits, *out.shape, dtype=dtype, device=out.device)


@functools.cache  # asked once per device, not on every matmul
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


@functools.cache  # asked once per device, not on every matmul
def shared_memory_limit(device: torch.device) -> int:
    """The shared memory one program may take on this NVIDIA GPU (its opt-in maximum), bytes."""
    return torch.cuda.get_device_properties(device).shared_memory_per_block_optin


@functools.cache  # asked once per device, not on every matmul
def nvidia_capability(device: torch.device) -> tuple[int, int] | None:
    """The compute capability of an NVIDIA GPU, None for other devices (ROCm's GPUs included: their 9.x is not
    Hopper): which of the quantized kernels run there."""
    if device.type != "cuda" or torch.version.hip is not None:
        return None
    return torch.cuda.get_device_capability(device)


def plan_split_k(m: int, n: int, k: int, block_m: int, block_n: int, block_k: int, programs_per_sm: int,
                 device: torch.device, min_k_blocks: int = 1) -> SplitKPlan:
    """The most splits, a power of two up to 16, that keeps the programs within programs_per_sm per SM and gives
    every split at least min_k_blocks blocks of K."""
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    k_blocks = triton.cdiv(k, block_k)
    splits = 1
    while (splits < _MAX_SPLITS and 2 * splits * min_k_blocks <= k_blocks
           and 2 * splits * tiles <= programs_per_sm * _num_sms(device)):
        splits *= 2
    blocks_per_split = triton.cdiv(k_blocks, splits)
    return SplitKPlan(block_m, block_n, block_k, blocks_per_split * block_k, triton.cdiv(k_blocks, blocks_per_split))


@triton.jit
def epilogue(acc, rm, rn, M, N, row_scale_ptr, col_scale_ptr, bias_ptr, HAS_ROW_SCALE: tl.constexpr,
             HAS_COL_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr):
    """acc [BM, BN] (fp32 or int32) -> fp32 acc * row_scale[m] * col_scale[n] + bias[n]."""
    out = acc.to(tl.float32)
    if HAS_ROW_SCALE:
        out = out * tl.load(row_scale_ptr + rm, mask=rm < M, other=0.0)[:, None]
    if HAS_COL_SCALE:
        out = out * tl.load(col_scale_ptr + rn, mask=rn < N, other=0.0)[None, :]
    if HAS_BIAS:
        out = out + tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    return out


@triton.jit(do_not_specialize=["M"])  # any row count, one compiled variant (see quant_weight_only.py)
def _reduce_splits_kernel(partial_ptr, out_ptr, row_scale_ptr, col_scale_ptr, bias_ptr, M, N, SPLITS: tl.constexpr,
                          HAS_ROW_SCALE: tl.constexpr, HAS_COL_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr):
    early_start(PDL)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    offsets = rm[:, None].to(tl.int64) * N + rn[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=partial_ptr.dtype.element_ty)  # int32 partials add exactly
    for split in range(SPLITS):  # a fixed order: the same sum on every run
        acc += tl.load(partial_ptr + split * M * N + offsets, mask=mask, other=0)
    out = epilogue(acc, rm, rn, M, N, row_scale_ptr, col_scale_ptr, bias_ptr, HAS_ROW_SCALE, HAS_COL_SCALE, HAS_BIAS)
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=mask)


def reduce_splits(partials: torch.Tensor, out: torch.Tensor, row_scale: torch.Tensor | None,
                  col_scale: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    """out [M, N] = epilogue(sum over splits of partials [S, M, N]); absent scales and bias are skipped. One split
    is a plain epilogue: quant_w8a8.py scales torch._int_mm's int32 output with it."""
    splits, m, n = partials.shape
    block_m, block_n = min(16, triton.next_power_of_2(m)), 128
    _reduce_splits_kernel[(triton.cdiv(n, block_n), triton.cdiv(m, block_m))](
        partials, out, row_scale if row_scale is not None else out, col_scale if col_scale is not None else out,
        bias if bias is not None else out, m, n, SPLITS=splits, HAS_ROW_SCALE=row_scale is not None,
        HAS_COL_SCALE=col_scale is not None, HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=4, **early_launch(partials.device))
    return out
