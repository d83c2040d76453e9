"""Weight-only int8 / int4 / grouped 8-bit matmuls (Triton): y = x @ dequant(W)^T with the weight dequantized inside
the kernel.

Decode is memory-bound: its speed is the speed of reading the weights, so they are read as 1 byte (int8) or
half a byte (int4) each and widened in registers. Layouts (made by the quantizers below):
  int8: qweight int8 [N, K], one fp32 scale per output channel [N]: W = q * scale[n] (applied after the sum)
  int4: qweight uint8 [N, K/2], byte j of a row holds k = 2j (low nibble) and k = 2j+1 (high nibble); per group
        of `group_size` consecutive k, an fp16 scale and minimum [N, K/group]: W = q * scale + minimum
        (asymmetric, the CPU layers' and GGUF Q4_1's convention; fp16 holds GGUF's own scales exactly; tinygemm's
        bf16 scale and zero round them)
  uint8 grouped (code_bits=8): qweight uint8 [N, K], one code 0..255 a weight; per group of `group_size`
        consecutive k an fp32 (or fp16) scale and minimum [N, K/group]: W = q * scale + minimum (GGUF's Q8_0, Q5_K and
        Q6_K blocks as stored: layers/quantization/uint8_grouped.py; fp32 holds their scales exactly)
  int4, tinygemm's layout (bf16 layers on a GPU): int32 [N/8, K/32, 32, 1] (pack_int4_tinygemm), scale and zero
        (code 8's value) per group [K/group, N, 2]: the bytes torch._weight_int4pack_mm reads
The quantizers are the CPU layers' (layers/quantization/int8.py, int4.py); pack_int4_codes and pack_int4_tinygemm
make the bytes. Row-major: one row goes through gemv.py's matrix-vector kernel (int8 in bf16 on Hopper and later:
int8_gemv.py's Gluon kernel), up to FUSED_MAX_ROWS through the kernel here (split K, quant_split_k.py). tinygemm's
layout: one bf16 row through int4_gemv.py's Gluon kernel, 2 to FUSED_MAX_ROWS through int4_mma.py's (Triton
without Gluon: up to TINYGEMM_MAX_ROWS bf16 rows through torch's kernel), other rows and dtypes through the kernel
here. More rows (prefill) dequantize the weight once and call cuBLAS, compute-bound there anyway.
"""
from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from fasterllm.kernels.dependent_launch import early_launch, early_start
from fasterllm.kernels.gemv import gemv, small_int_to_float
from fasterllm.kernels.quant_split_k import SplitKPlan, epilogue, nvidia_capability, plan_split_k, reduce_splits

FUSED_MAX_ROWS = 64  # the tile table below covers 2 to 64 rows
TINYGEMM_MAX_ROWS = 4  # tinygemm_matmul without Gluon: torch's kernel up to here (measured: RESULTS.md)


@dataclass(frozen=True)
class _Tiles:
    """How the kernel below tiles a few rows: SWAP computes W x^T (the weight tile is tl.dot's first operand, the
    rows its second, padded to 16) instead of x W^T; the split of K aims at programs_per_sm programs per SM."""
    swap: bool
    block_n: int
    block_k: int
    stages: int
    programs_per_sm: int


# (int4, up to this many rows) -> tiles (the grouped 8-bit layout takes int8's: as many bytes a tile; not timed on
# its own yet). Chosen on an H100 by timing 94 int8 and 70 int4 candidates (tile sizes, stages, both operand orders,
# 1-16 splits) at 16, 32 and 64 rows on the Llama-3-8B projections: each entry is the one whose slowest projection is
# closest to that projection's best candidate (within 4-24%); RESULTS.md.
_TILES = {
    (False, 16): _Tiles(False, 64, 256, 3, 4), (False, 32): _Tiles(False, 64, 128, 3, 4),
    (False, 64): _Tiles(False, 128, 128, 3, 2),
    (True, 16): _Tiles(True, 64, 128, 3, 4), (True, 32): _Tiles(True, 64, 128, 3, 4),
    (True, 64): _Tiles(True, 64, 128, 3, 2),
}


@triton.jit
def _row_bases(w_ptr, rn, K, stride_wn, TINYGEMM: tl.constexpr):
    """[BLOCK_N, 1] pointers to where each weight row starts: row-major, or tinygemm's blocks of 8 rows whose
    32-k tiles of 16 bytes follow each other (see _byte_offsets)."""
    if TINYGEMM:
        return w_ptr + ((rn // 8).to(tl.int64) * (4 * K) + (rn % 8) * 16)[:, None]
    return w_ptr + rn[:, None].to(tl.int64) * stride_wn


@triton.jit
def _byte_offsets(half, TINYGEMM: tl.constexpr):
    """Byte j of a row (as if row-major) -> its offset from the row's base: tinygemm puts a row's 16 bytes of
    each 32-k tile 128 bytes (8 rows) after the previous tile's."""
    if TINYGEMM:
        return (half // 16) * 128 + half % 16
    return half


# tinygemm's order within a 32-k tile (torch._convert_weight_to_int4pack with 2 inner k tiles): byte 4j + c of a
# row's 16 holds k = 2j + c // 2 + 16 (c % 2) in its low nibble h = 0 and that k + 8 in its high nibble h = 1.
# So a tile's column e = 2 (4j + c) + h, bits (j1 j0 c1 c0 h), is k with bits (k4..k0) = (c0 h j1 j0 c1): a
# permutation of index bits, done in registers with reshape + permute (gathered loads and scattered stores of
# single elements made the 64-row and prefill paths 3-10x slower).


@triton.jit
def _tinygemm_to_k_order(tile, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """[ROWS, BLOCK_K] columns in tinygemm's order -> in k order."""
    bits = tl.reshape(tile, (ROWS, BLOCK_K // 32, 2, 2, 2, 2, 2))  # (j1 j0 c1 c0 h)
    return tl.reshape(tl.permute(bits, (0, 1, 5, 6, 2, 3, 4)), (ROWS, BLOCK_K))  # (c0 h j1 j0 c1)


@triton.jit
def _k_to_tinygemm_order(tile, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """[ROWS, BLOCK_K] columns in k order -> in tinygemm's order (the inverse of _tinygemm_to_k_order)."""
    bits = tl.reshape(tile, (ROWS, BLOCK_K // 32, 2, 2, 2, 2, 2))  # (k4 k3 k2 k1 k0) = (c0 h j1 j0 c1)
    return tl.reshape(tl.permute(bits, (0, 1, 4, 5, 6, 2, 3)), (ROWS, BLOCK_K))  # (j1 j0 c1 c0 h)


@triton.jit
def _weight_tile(w_rows, group_scale_ptr, group_min_ptr, rn, n_mask, k0, K, stride_gn, stride_gg,
                 GROUP: tl.constexpr, GROUPED_BITS: tl.constexpr, TINYGEMM: tl.constexpr, EVEN: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, dtype: tl.constexpr):
    """Weight rows rn, columns k0 .. k0 + BLOCK_K (in tinygemm's order for its layout) as a [BLOCK_N, BLOCK_K] tile
    in dtype, loaded as stored: int8 codes as they are (GROUPED_BITS 0: their row scale comes after the sum), grouped
    codes (GROUPED_BITS 4: two a byte, 8: one a byte) dequantized in fp32 and rounded once, with one scale and
    minimum (tinygemm: zero, code 8's value) loaded per (row, group)."""
    if GROUPED_BITS:
        PER_BYTE: tl.constexpr = 8 // GROUPED_BITS  # codes a byte
        index = k0 // PER_BYTE + tl.arange(0, BLOCK_K // PER_BYTE)  # bytes along the row
        groups = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
        group_offsets = rn[:, None].to(tl.int64) * stride_gn + groups[None, :].to(tl.int64) * stride_gg
        columns = _byte_offsets(index, TINYGEMM)
        if EVEN:
            packed = tl.load(w_rows + columns[None, :])
            scale = tl.load(group_scale_ptr + group_offsets)
            minimum = tl.load(group_min_ptr + group_offsets)
        else:
            packed = tl.load(w_rows + columns[None, :], mask=n_mask[:, None] & (index < K // PER_BYTE)[None, :],
                             other=0)
            group_mask = n_mask[:, None] & (groups < K // GROUP)[None, :]
            scale = tl.load(group_scale_ptr + group_offsets, mask=group_mask, other=0.0)
            minimum = tl.load(group_min_ptr + group_offsets, mask=group_mask, other=0.0)
        scale = scale.to(tl.float32)[:, :, None]
        minimum = minimum.to(tl.float32)[:, :, None]
        if TINYGEMM:  # stored: the zero (code 8's value)
            minimum -= 8.0 * scale
        # byte j of a group: k = 2j, 2j + 1 (int4) or k = j
        codes = tl.reshape(packed, (BLOCK_N, BLOCK_K // GROUP, GROUP // PER_BYTE)).to(tl.int32)
        if GROUPED_BITS == 8:  # code * scale is exact: one rounding, in the addition, as the reference's
            tile = tl.reshape((small_int_to_float(codes, 0) * scale + minimum).to(dtype), (BLOCK_N, BLOCK_K))
        else:
            low = (small_int_to_float(codes & 0xF, 0) * scale + minimum).to(dtype)
            high = (small_int_to_float(codes >> 4, 0) * scale + minimum).to(dtype)
            tile = tl.reshape(tl.join(low, high), (BLOCK_N, BLOCK_K))  # (n, group, byte, nibble)
        return tile
    else:
        kk = k0 + tl.arange(0, BLOCK_K)
        if EVEN:
            codes = tl.load(w_rows + kk[None, :])
        else:
            codes = tl.load(w_rows + kk[None, :], mask=n_mask[:, None] & (kk < K)[None, :], other=0)
        return codes.to(dtype)


# M is not specialized (Triton compiles a variant for M % 16 == 0 otherwise): the row count changes from step to
# step, and a prefill's logits rows compiled new variants inside (c)'s first timed run (1.0 s)
@triton.jit(do_not_specialize=["M"])
def _weight_only_kernel(x_ptr, w_ptr, group_scale_ptr, group_min_ptr, col_scale_ptr, bias_ptr, out_ptr, M, N, K,
                        stride_xm, stride_wn, stride_gn, stride_gg, k_per_split, GROUP: tl.constexpr,
                        GROUPED_BITS: tl.constexpr, TINYGEMM: tl.constexpr, EVEN: tl.constexpr, SWAP: tl.constexpr,
                        DIRECT: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    early_start(PDL)
    pid_n, pid_k, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = rm < M, rn < N
    w_rows = _row_bases(w_ptr, rn, K, stride_wn, TINYGEMM)
    x_rows = x_ptr + rm.to(tl.int64) * stride_xm
    dtype = x_ptr.dtype.element_ty
    k_start = pid_k * k_per_split
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, tl.minimum(K, k_start + k_per_split), BLOCK_K):
        w = _weight_tile(w_rows, group_scale_ptr, group_min_ptr, rn, n_mask, k0, K, stride_gn, stride_gg, GROUP,
                         GROUPED_BITS, TINYGEMM, EVEN, BLOCK_N, BLOCK_K, dtype)
        kk = k0 + tl.arange(0, BLOCK_K)
        k_mask = kk < K
        if SWAP:  # x^T [BLOCK_K, BLOCK_M]
            xt = tl.load(x_rows[None, :] + kk[:, None], mask=m_mask[None, :] & k_mask[:, None], other=0.0)
            if TINYGEMM:  # the x rows in the weight tile's column order
                xt = tl.trans(_k_to_tinygemm_order(tl.trans(xt), BLOCK_M, BLOCK_K))
            acc = tl.dot(w, xt, acc, input_precision=PRECISION)
        else:
            tl.static_assert(not TINYGEMM, "the int4 tiles are W x^T (SWAP): tinygemm's order is undone there only")
            xb = tl.load(x_rows[:, None] + kk[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            acc = tl.dot(xb, tl.trans(w), acc, input_precision=PRECISION)
    if SWAP:
        acc = tl.trans(acc)
    offsets = rm[:, None].to(tl.int64) * N + rn[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    if DIRECT:  # one split: the epilogue here, no second launch
        out = epilogue(acc, rm, rn, M, N, col_scale_ptr, col_scale_ptr, bias_ptr, False, GROUPED_BITS == 0,
                       HAS_BIAS)
        tl.store(out_ptr + offsets, out.to(dtype), mask=mask)
    else:
        tl.store(out_ptr + pid_k * M * N + offsets, acc, mask=mask)


@triton.jit
def _dequantize_kernel(w_ptr, group_scale_ptr, group_min_ptr, out_ptr, N, K, stride_wn, stride_gn, stride_gg,
                       GROUP: tl.constexpr, GROUPED_BITS: tl.constexpr, TINYGEMM: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    n_mask = rn < N
    w_rows = _row_bases(w_ptr, rn, K, stride_wn, TINYGEMM)
    if GROUPED_BITS:
        w = _weight_tile(w_rows, group_scale_ptr, group_min_ptr, rn, n_mask, k0, K, stride_gn, stride_gg, GROUP,
                         GROUPED_BITS, TINYGEMM, False, BLOCK_N, BLOCK_K, out_ptr.dtype.element_ty)
    else:  # the row scale folded in: one rounding to the output dtype
        codes = _weight_tile(w_rows, group_scale_ptr, group_min_ptr, rn, n_mask, k0, K, stride_gn, stride_gg, GROUP,
                             0, False, False, BLOCK_N, BLOCK_K, tl.float32)
        scale = tl.load(group_scale_ptr + rn, mask=n_mask, other=0.0)
        w = (codes * scale[:, None]).to(out_ptr.dtype.element_ty)
    if TINYGEMM:
        w = _tinygemm_to_k_order(w, BLOCK_N, BLOCK_K)
    kk = k0 + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + rn[:, None].to(tl.int64) * K + kk[None, :], w, mask=n_mask[:, None] & (kk < K)[None, :])


@dataclass(frozen=True)
class _KernelWeight:
    """A quantized weight [n, k] as the kernels here read it: its bytes, where its per-group scales and minimums
    (tinygemm: zeros) are ([n, k/group] strides (stride_gn, stride_gg)), and its layout: grouped_bits 4 or 8 (codes
    a group), 0 for int8, which has no groups: its per-row scales stand in for both and are applied after the sum."""
    data: torch.Tensor
    group_scales: torch.Tensor
    group_mins: torch.Tensor
    n: int
    k: int
    stride_wn: int
    stride_gn: int
    stride_gg: int
    group: int
    grouped_bits: int
    tinygemm: bool


def _row_major(qweight: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor | None, group_size: int,
               code_bits: int) -> _KernelWeight:
    if minimums is None:  # int8
        return _KernelWeight(qweight, scales, scales, qweight.shape[0], qweight.shape[1], qweight.stride(0), 0, 0, 1,
                             0, False)
    if code_bits not in (4, 8):
        raise ValueError(f"code_bits={code_bits}: grouped codes are 4 bits (two a byte) or 8 bits (one a byte)")
    k = qweight.shape[1] * 8 // code_bits
    _check_group(group_size, k)
    return _KernelWeight(qweight, scales, minimums, qweight.shape[0], k, qweight.stride(0), scales.stride(0), 1,
                         group_size, code_bits, False)


def _tinygemm(packed: torch.Tensor, scale_zeros: torch.Tensor, group_size: int) -> _KernelWeight:
    if packed.dim() != 4 or packed.shape[2:] != (32, 1) or packed.dtype != torch.int32:
        raise ValueError(f"a tinygemm int4 weight is int32 [N/8, K/32, 32, 1] (pack_int4_tinygemm), got "
                         f"{packed.dtype} {tuple(packed.shape)}")
    n, k = packed.shape[0] * 8, packed.shape[1] * 32
    if group_size not in (32, 64, 128, 256) or k % group_size:
        raise ValueError(f"group_size={group_size} must be 32, 64, 128 or 256 and divide in_features={k} in "
                         "tinygemm's layout (each 32-k tile of a row lies in one group)")
    if scale_zeros.shape != (k // group_size, n, 2) or not scale_zeros.is_contiguous():
        raise ValueError(f"scale_zeros must be contiguous [{k // group_size}, {n}, 2], got "
                         f"{tuple(scale_zeros.shape)}")
    # [K/group, N, 2]: a group's scale, then its zero; rows (the byte addressing) follow from n and k
    return _KernelWeight(packed.view(torch.uint8), scale_zeros[..., 0], scale_zeros[..., 1], n, k, 0, 2, 2 * n,
                         group_size, 4, True)


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor | None, group_size: int,
               dtype: torch.dtype, code_bits: int = 4) -> torch.Tensor:
    """The int8 (minimums None), int4 or grouped 8-bit (code_bits=8) layout -> the float weight [N, K] in dtype, in
    one pass (the large-M path: reads 1 or 0.5 bytes a weight and writes the float once, where int8 codes cast by
    torch and scaled after the product took two passes and a third over the output)."""
    return _dequantize(_row_major(qweight, scales, minimums, group_size, code_bits), dtype)


def dequantize_tinygemm(packed: torch.Tensor, scale_zeros: torch.Tensor, group_size: int,
                        dtype: torch.dtype) -> torch.Tensor:
    """tinygemm's int4 layout (pack_int4_tinygemm, scale_zeros [K/group, N, 2]) -> the float weight [N, K]."""
    return _dequantize(_tinygemm(packed, scale_zeros, group_size), dtype)


def _dequantize(w: _KernelWeight, dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty(w.n, w.k, dtype=dtype, device=w.data.device)
    block_n, block_k = 64, max(256, w.group)
    _dequantize_kernel[(triton.cdiv(w.n, block_n), triton.cdiv(w.k, block_k))](
        w.data, w.group_scales, w.group_mins, out, w.n, w.k, w.stride_wn, w.stride_gn, w.stride_gg, GROUP=w.group,
        GROUPED_BITS=w.grouped_bits, TINYGEMM=w.tinygemm, BLOCK_N=block_n, BLOCK_K=block_k)
    return out


def weight_only_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
                       minimums: torch.Tensor | None = None, group_size: int = 0, code_bits: int = 4) -> torch.Tensor:
    """x [M, K] (bf16/fp16/fp32) times a quantized weight -> [M, N]: int8 when minimums is None, else grouped codes
    of code_bits (4: int4 bytes [N, K/2]; 8: uint8 codes [N, K]). One row: int8 codes with fp32 scales times a bf16
    row on an NVIDIA GPU of compute capability 9.0+ (PDL, where its gain was measured) through int8_gemv.py's Gluon
    kernel where Triton has Gluon and int8_gemv.fits holds (K a multiple of 16, 16-byte aligned rows and x), the rest
    through gemv.py's Triton kernel."""
    grouped = minimums is not None
    m, k = x.shape
    w = _row_major(qweight, scales, minimums, group_size, code_bits)
    if x.stride(-1) != 1 or w.k != k:
        raise ValueError(f"x {tuple(x.shape)} (contiguous last dim) does not fit the weight "
                         f"{tuple(qweight.shape)}{' (two int4 per byte)' if grouped and code_bits == 4 else ''}")
    if m > FUSED_MAX_ROWS:  # prefill: compute-bound, cuBLAS on a dequantized copy
        return F.linear(x, _dequantize(w, x.dtype), bias)
    if m == 1:  # batch-1 decode: a matrix-vector product streaming the weight bytes
        int8_kernel = _gluon("int8_gemv") if not grouped and (nvidia_capability(x.device) or (0, 0)) >= (9, 0) else None
        if int8_kernel is not None and int8_kernel.fits(x, qweight) and scales.dtype == torch.float32:
            return int8_kernel.int8_gemv(x, qweight, scales, bias)
        return gemv(x, qweight, scales, bias, minimums, group_size, code_bits)
    return _matmul_tiles(x, w, None if grouped else scales, bias)


def tinygemm_matmul(x: torch.Tensor, packed: torch.Tensor, scale_zeros: torch.Tensor, group_size: int,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] times an int4 weight in tinygemm's layout (pack_int4_tinygemm; scale_zeros [K/group, N, 2]: scale
    and the value of code 8 per group) -> [M, N]. bf16 on an NVIDIA GPU (bf16 scale_zeros) where Triton has Gluon: one
    row through int4_gemv.py's kernel (8B shape, H100: batch-1 TPOT 3.27 -> 2.65 ms; int4_mma's W x^T alone is
    faster, 7-13% a layer, but not in the decode step in any form tried: H200, 2.41-2.60 against 2.27-2.39 ms), 2
    to FUSED_MAX_ROWS rows through int4_mma.py's tensor-core kernel (H200, Llama-3-8B's projections: 1.7-2.4x bf16
    cuBLAS at 2-8 rows, 1.4-2.3x at 16, 1.0-1.7x at 64 with Hopper's wgmma, ahead of torch._weight_int4pack_mm at
    every one: RESULTS.md); without Gluon, up to TINYGEMM_MAX_ROWS rows through torch's kernel. Other rows and dtypes
    through this file's Triton kernels reading the same bytes."""
    w = _tinygemm(packed, scale_zeros, group_size)
    m, k = x.shape
    if x.stride(-1) != 1 or w.k != k:
        raise ValueError(f"x {tuple(x.shape)} (contiguous last dim) does not fit the int4 weight [{w.n}, {w.k}]")
    bf16_on_nvidia = x.dtype == scale_zeros.dtype == torch.bfloat16 and tinygemm_kernel_available(x.device)
    if bf16_on_nvidia and 0 < m <= FUSED_MAX_ROWS:
        gluon_kernels = _gluon("int4_gemv"), _gluon("int4_mma")
        if m == 1 and gluon_kernels[0] is not None:
            return gluon_kernels[0].int4_gemv(x, packed, scale_zeros, group_size, bias)
        if gluon_kernels[1] is not None:
            return gluon_kernels[1].int4_mma(x, packed, scale_zeros, group_size, bias)
        if m <= TINYGEMM_MAX_ROWS:  # Triton without Gluon
            out = torch._weight_int4pack_mm(x.contiguous(), packed, group_size, scale_zeros)
            return out if bias is None else out + bias
    if m > FUSED_MAX_ROWS:
        return F.linear(x, _dequantize(w, x.dtype), bias)
    return _matmul_tiles(x, w, None, bias)


@functools.cache
def _gluon(module: str):
    """The Gluon kernel module kernels/<module>.py (int4_gemv, int8_gemv: one row on an NVIDIA GPU; int4_mma: 2-64
    rows), or None where Triton has no Gluon (torch's tinygemm kernel, this file's and gemv.py's Triton kernels
    then)."""
    try:
        return importlib.import_module(f"fasterllm.kernels.{module}")
    except ImportError as exc:  # Triton without Gluon; any other import error is a bug to show
        if (exc.name or "").startswith("triton"):
            return None
        raise


def tinygemm_kernel_available(device: torch.device) -> bool:
    """torch._weight_int4pack_mm reads pack_int4_tinygemm's bytes on NVIDIA GPUs of compute capability 8.0+ (ROCm's
    build expects another order)."""
    return (nvidia_capability(device) or (0, 0)) >= (8, 0)


def _matmul_tiles(x: torch.Tensor, w: _KernelWeight, col_scales: torch.Tensor | None,
                  bias: torch.Tensor | None) -> torch.Tensor:
    """Up to FUSED_MAX_ROWS rows through the split-K kernel with the tile table's tiles."""
    m, k = x.shape
    out = torch.empty(m, w.n, dtype=x.dtype, device=x.device)
    if m == 0:  # before planning: no tiles to split
        return out
    block_m = max(16, triton.next_power_of_2(m))  # tl.dot takes 16 rows or more; padding rows are masked
    tiles = _TILES[w.grouped_bits == 4, block_m]
    # whole groups per tile
    plan = plan_split_k(m, w.n, k, block_m, tiles.block_n, max(tiles.block_k, w.group), tiles.programs_per_sm,
                        x.device)
    target = plan.partial_sums(out)
    direct = target is out
    _weight_only_kernel[plan.grid(m, w.n)](
        x, w.data, w.group_scales, w.group_mins, col_scales if col_scales is not None else out,
        bias if bias is not None else out, target, m, w.n, k, x.stride(0), w.stride_wn, w.stride_gn, w.stride_gg,
        plan.k_per_split, GROUP=w.group, GROUPED_BITS=w.grouped_bits, TINYGEMM=w.tinygemm,
        EVEN=w.n % plan.block_n == 0 and k % plan.block_k == 0, SWAP=tiles.swap, DIRECT=direct,
        HAS_BIAS=bias is not None, PRECISION="ieee" if x.dtype == torch.float32 else "tf32", BLOCK_M=plan.block_m,
        BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, num_warps=4,
        num_stages=_stages(tiles.stages, plan, x.element_size()), **early_launch(x.device))
    return out if direct else reduce_splits(target, out, None, col_scales, bias)


def _check_group(group_size: int, k: int) -> None:
    if group_size < 2 or group_size & (group_size - 1) or group_size > 256 or k % group_size:
        raise ValueError(f"group_size={group_size} must be a power of two from 2 to 256 that divides "
                         f"in_features={k} (the kernels reshape a tile into whole groups)")


def _stages(wanted: int, plan: SplitKPlan, x_bytes: int) -> int:
    """Pipeline depth whose shared memory fits a Hopper SM's 227 KiB with room to spare: per stage an x tile and a
    weight tile of codes, plus one widened weight tile for tl.dot (an fp32 x takes twice a bf16 one)."""
    widened = plan.block_n * plan.block_k * x_bytes
    per_stage = plan.block_m * plan.block_k * x_bytes + plan.block_n * plan.block_k
    return max(1, min(wanted, (192 * 1024 - widened) // per_stage))


def pack_int4_codes(codes: torch.Tensor) -> torch.Tensor:
    """Codes uint8 [N, K] in 0..15 -> the kernel's bytes [N, K/2]: k = 2j in the low nibble of byte j, 2j+1 high."""
    if codes.shape[1] % 2:
        raise ValueError(f"int4 packs two codes per byte: in_features={codes.shape[1]} must be even")
    codes = codes.to(torch.uint8)
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()


def pack_int4_tinygemm(codes: torch.Tensor) -> torch.Tensor:
    """Codes uint8 [N, K] in 0..15 -> int32 [N/8, K/32, 32, 1], the bytes torch._convert_weight_to_int4pack makes
    with 2 inner k tiles (checked on a GPU by the tests): blocks of 8 rows; in each, a row's 32-k tile is 4 words,
    word j holding k = 2j + p // 4 + 8 (p % 4) in its nibble p. Built here with torch ops so that it runs, and
    is tested, without a GPU."""
    n, k = codes.shape
    if n % 8 or k % 32:
        raise ValueError(f"tinygemm's int4 layout needs out_features % 8 == 0 and in_features % 32 == 0, got "
                         f"[{n}, {k}]")
    j, c, h = torch.arange(4)[:, None, None], torch.arange(4)[None, :, None], torch.arange(2)[None, None, :]
    order = (2 * j + c // 2 + 16 * (c % 2) + 8 * h).reshape(-1).to(codes.device)  # (word j, byte c, nibble h) -> k
    tiles = codes.to(torch.uint8).reshape(n // 8, 8, k // 32, 32).transpose(1, 2)[..., order]
    nibbles = tiles.reshape(n // 8, k // 32, 8, 16, 2)
    # little-endian: byte c of word j is bits 8c..8c+7 of the int32
    return (nibbles[..., 0] | (nibbles[..., 1] << 4)).contiguous().view(torch.int32).reshape(n // 8, k // 32, 32, 1)


def dequantize_reference(qweight: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor | None = None,
                         group_size: int = 0, code_bits: int = 4) -> torch.Tensor:
    """The fp32 weight [N, K] a quantized layout stands for (torch, the reference)."""
    if minimums is None:
        return qweight.float() * scales.float()[:, None]
    n = qweight.shape[0]
    q = qweight.float() if code_bits == 8 else torch.stack([qweight & 0xF, qweight >> 4], dim=-1).view(n, -1).float()
    expand = lambda t: t.float().repeat_interleave(group_size, dim=1)  # noqa: E731
    return q * expand(scales) + expand(minimums)


def tinygemm_reference(codes: torch.Tensor, scale_zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """The fp32 weight [N, K] codes uint8 [N, K] stand for with tinygemm's scale_zeros [K/group, N, 2] (torch, the
    reference): (codes - 8) * scale + zero."""
    scale, zero = (t.float().t().repeat_interleave(group_size, dim=1) for t in scale_zeros.unbind(-1))
    return (codes.float() - 8) * scale + zero


def weight_only_matmul_reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                                 bias: torch.Tensor | None = None, minimums: torch.Tensor | None = None,
                                 group_size: int = 0, code_bits: int = 4) -> torch.Tensor:
    out = x.float() @ dequantize_reference(qweight, scales, minimums, group_size, code_bits).t()
    return (out if bias is None else out + bias.float()).to(x.dtype)
