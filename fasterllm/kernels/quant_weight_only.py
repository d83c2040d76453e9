"""Weight-only int8 / int4 matmuls (Triton): y = x @ dequant(W)^T with the weight dequantized inside the kernel.

Decode is memory-bound: its speed is the speed of reading the weights, so they are read as 1 byte (int8) or
half a byte (int4) each and widened in registers. Layouts (made by the quantizers below):
  int8: qweight int8 [N, K], one fp32 scale per output channel [N]: W = q * scale[n] (applied after the sum)
  int4: qweight uint8 [N, K/2], byte j of a row holds k = 2j (low nibble) and k = 2j+1 (high nibble); per group
        of `group_size` consecutive k, an fp16 scale and minimum [N, K/group]: W = q * scale + minimum
        (asymmetric, the CPU layers' and GGUF Q4_1's convention; fp16 holds GGUF's own scales exactly)
The quantizers are the CPU layers' (layers/quantization/int8.py, int4.py); pack_int4_codes makes the bytes.
One row goes through gemv.py's matrix-vector kernel, up to FUSED_MAX_ROWS through the kernel here (split K,
quant_split_k.py); more rows (prefill) dequantize the weight once and call cuBLAS, compute-bound there anyway.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from fasterllm.kernels.gemv import gemv
from fasterllm.kernels.quant_split_k import epilogue, plan_split_k, reduce_splits

FUSED_MAX_ROWS = 64
_BLOCK_N, _BLOCK_K = 64, 256  # 64 rows x 256 bytes (int8) or 128 bytes (int4) of weight per step


@triton.jit
def _int4_tile(w_cols, group_scale_ptr, group_min_ptr, rn, n_mask, half, K, stride_gn, GROUP: tl.constexpr,
               dtype: tl.constexpr):
    """Bytes half[:] of columns rn -> the dequantized (even k, odd k) weight tiles [len(half), BLOCK_N] in dtype."""
    k_mask = half < K // 2
    mask = k_mask[:, None] & n_mask[None, :]
    packed = tl.load(w_cols + half[:, None], mask=mask, other=0)
    group_offsets = rn[None, :].to(tl.int64) * stride_gn + ((2 * half) // GROUP)[:, None]
    scale = tl.load(group_scale_ptr + group_offsets, mask=mask, other=0.0).to(tl.float32)
    minimum = tl.load(group_min_ptr + group_offsets, mask=mask, other=0.0).to(tl.float32)
    even = ((packed & 0xF).to(tl.float32) * scale + minimum).to(dtype)
    odd = ((packed >> 4).to(tl.float32) * scale + minimum).to(dtype)
    return even, odd


@triton.jit
def _weight_only_kernel(x_ptr, w_ptr, group_scale_ptr, group_min_ptr, col_scale_ptr, bias_ptr, out_ptr, M, N, K,
                        stride_xm, stride_wn, stride_gn, K_PER_SPLIT: tl.constexpr, GROUP: tl.constexpr,
                        INT4: tl.constexpr, DIRECT: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n, pid_k, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = rm < M, rn < N
    x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_xm
    w_cols = w_ptr + rn[None, :].to(tl.int64) * stride_wn
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_start = pid_k * K_PER_SPLIT
    for k0 in range(k_start, k_start + K_PER_SPLIT, BLOCK_K):
        if INT4:
            half = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            even, odd = _int4_tile(w_cols, group_scale_ptr, group_min_ptr, rn, n_mask, half, K, stride_gn, GROUP,
                                   dtype)
            x_mask = m_mask[:, None] & (half < K // 2)[None, :]
            x_even = tl.load(x_rows + 2 * half[None, :], mask=x_mask, other=0.0)
            x_odd = tl.load(x_rows + 2 * half[None, :] + 1, mask=x_mask, other=0.0)
            acc = tl.dot(x_even, even, acc, input_precision=PRECISION)
            acc = tl.dot(x_odd, odd, acc, input_precision=PRECISION)
        else:
            kk = k0 + tl.arange(0, BLOCK_K)
            k_mask = kk < K
            w = tl.load(w_cols + kk[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0).to(dtype)
            xb = tl.load(x_rows + kk[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            acc = tl.dot(xb, w, acc, input_precision=PRECISION)
    offsets = rm[:, None].to(tl.int64) * N + rn[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    if DIRECT:  # one split: the epilogue here, no second launch
        out = epilogue(acc, rm, rn, M, N, col_scale_ptr, col_scale_ptr, bias_ptr, False, not INT4, HAS_BIAS)
        tl.store(out_ptr + offsets, out.to(dtype), mask=mask)
    else:
        tl.store(out_ptr + pid_k * M * N + offsets, acc, mask=mask)


@triton.jit
def _dequantize_int4_kernel(w_ptr, group_scale_ptr, group_min_ptr, out_ptr, N, K, stride_wn, stride_gn,
                            GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    half = tl.program_id(1) * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
    n_mask = rn < N
    even, odd = _int4_tile(w_ptr + rn[None, :].to(tl.int64) * stride_wn, group_scale_ptr, group_min_ptr, rn, n_mask,
                           half, K, stride_gn, GROUP, out_ptr.dtype.element_ty)
    out = out_ptr + rn[None, :].to(tl.int64) * K + 2 * half[:, None]
    mask = (half < K // 2)[:, None] & n_mask[None, :]
    tl.store(out, even, mask=mask)
    tl.store(out + 1, odd, mask=mask)


def dequantize_int4(qweight: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor, group_size: int,
                    dtype: torch.dtype) -> torch.Tensor:
    """The int4 layout -> the float weight [N, K] in dtype (one pass, for the large-M path)."""
    n, k = qweight.shape[0], 2 * qweight.shape[1]
    out = torch.empty(n, k, dtype=dtype, device=qweight.device)
    _dequantize_int4_kernel[(triton.cdiv(n, _BLOCK_N), triton.cdiv(k, _BLOCK_K))](
        qweight, scales, minimums, out, n, k, qweight.stride(0), scales.stride(0), GROUP=group_size,
        BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K)
    return out


def weight_only_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
                       minimums: torch.Tensor | None = None, group_size: int = 0) -> torch.Tensor:
    """x [M, K] (bf16/fp16/fp32) times a quantized weight (int8 when minimums is None, else int4) -> [M, N]."""
    int4 = minimums is not None
    m, k = x.shape
    n = qweight.shape[0]
    if x.stride(-1) != 1 or qweight.shape[1] * (2 if int4 else 1) != k:
        raise ValueError(f"x {tuple(x.shape)} (contiguous last dim) does not fit the weight "
                         f"{tuple(qweight.shape)}{' (two int4 per byte)' if int4 else ''}")
    if int4 and (group_size % 2 or k % group_size):
        raise ValueError(f"group_size={group_size} must be even and divide in_features={k}")
    if m > FUSED_MAX_ROWS:  # prefill: compute-bound, cuBLAS on a dequantized copy
        if int4:
            return F.linear(x, dequantize_int4(qweight, scales, minimums, group_size, x.dtype), bias)
        out = F.linear(x, qweight.to(x.dtype)) * scales.to(x.dtype)
        return out if bias is None else out + bias
    if m == 1:  # batch-1 decode: a matrix-vector product streaming the weight bytes
        return gemv(x, qweight, scales, bias, minimums, group_size)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:  # before planning: no tiles to split
        return out
    plan = plan_split_k(m, n, k, _BLOCK_N, _BLOCK_K, x.device)
    direct = plan.splits == 1
    target = out if direct else torch.empty(plan.splits, m, n, dtype=torch.float32, device=x.device)
    col_scale = None if int4 else scales
    _weight_only_kernel[plan.grid(m, n)](
        x, qweight, scales, minimums if int4 else scales, scales, bias if bias is not None else out, target,
        m, n, k, x.stride(0), qweight.stride(0), scales.stride(0) if int4 else 0, K_PER_SPLIT=plan.k_per_split,
        GROUP=group_size if int4 else 1, INT4=int4, DIRECT=direct, HAS_BIAS=bias is not None,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", BLOCK_M=plan.block_m, BLOCK_N=plan.block_n,
        BLOCK_K=plan.block_k, num_warps=4, num_stages=_stages(plan.block_m * plan.block_k * x.element_size()
                                                                + plan.block_n * plan.block_k))
    return out if direct else reduce_splits(target, out, None, col_scale, bias)


def _stages(bytes_per_stage: int) -> int:
    """Pipeline depth whose shared-memory tiles (x and weight per stage) fit a Hopper SM's 227 KiB with room
    to spare: an fp32 x at 64 rows needed 304 KiB at 4 stages on the H100."""
    return max(1, min(4, 192 * 1024 // bytes_per_stage))


def pack_int4_codes(codes: torch.Tensor) -> torch.Tensor:
    """Codes uint8 [N, K] in 0..15 -> the kernel's bytes [N, K/2]: k = 2j in the low nibble of byte j, 2j+1 high."""
    if codes.shape[1] % 2:
        raise ValueError(f"int4 packs two codes per byte: in_features={codes.shape[1]} must be even")
    codes = codes.to(torch.uint8)
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()


def dequantize_reference(qweight: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor | None = None,
                         group_size: int = 0) -> torch.Tensor:
    """The fp32 weight [N, K] a quantized layout stands for (torch, the reference)."""
    if minimums is None:
        return qweight.float() * scales.float()[:, None]
    n = qweight.shape[0]
    q = torch.stack([qweight & 0xF, qweight >> 4], dim=-1).view(n, -1).float()
    expand = lambda t: t.float().repeat_interleave(group_size, dim=1)  # noqa: E731
    return q * expand(scales) + expand(minimums)


def weight_only_matmul_reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                                 bias: torch.Tensor | None = None, minimums: torch.Tensor | None = None,
                                 group_size: int = 0) -> torch.Tensor:
    out = x.float() @ dequantize_reference(qweight, scales, minimums, group_size).t()
    return (out if bias is None else out + bias.float()).to(x.dtype)
