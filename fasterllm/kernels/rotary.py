"""Rotary position embedding on Q and K in one launch (Triton), in place, one program per token.

The table is RotaryEmbedding.cos_sin: row p = [cos, cos, -sin, sin] (each D/2 wide; frequency scalings
such as llama3's are already inside it). Rounding follows fasterllm.layers.rotary.apply_rotary, the
reference: out = round(round(x * cos) + swap_halves(x) * sin), the product-sum in fp32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(x_ptr, stride_h, cos_lo, cos_hi, sin_lo, sin_hi, NUM_HEADS: tl.constexpr,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < NUM_HEADS) & (dims < HALF)
    lo_ptrs = x_ptr + heads * stride_h + dims
    lo = tl.load(lo_ptrs, mask=mask, other=0.0)
    hi = tl.load(lo_ptrs + HALF, mask=mask, other=0.0)
    dtype = lo.dtype
    lo_cos = (lo * cos_lo).to(dtype).to(tl.float32)  # the reference rounds x * cos before adding
    hi_cos = (hi * cos_hi).to(dtype).to(tl.float32)
    new_lo = lo_cos + hi.to(tl.float32) * sin_lo
    new_hi = hi_cos + lo.to(tl.float32) * sin_hi
    tl.store(lo_ptrs, new_lo.to(dtype), mask=mask)
    tl.store(lo_ptrs + HALF, new_hi.to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, positions_ptr, cos_sin_ptr, stride_qt, stride_qh, stride_kt, stride_kh,
                   stride_table, NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HALF: tl.constexpr,
                   BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_HALF: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    row = cos_sin_ptr + tl.load(positions_ptr + token).to(tl.int64) * stride_table
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = dims < HALF
    cos_lo = tl.load(row + dims, mask=mask, other=0.0).to(tl.float32)
    cos_hi = tl.load(row + HALF + dims, mask=mask, other=0.0).to(tl.float32)
    sin_lo = tl.load(row + 2 * HALF + dims, mask=mask, other=0.0).to(tl.float32)
    sin_hi = tl.load(row + 3 * HALF + dims, mask=mask, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr + token * stride_qt, stride_qh, cos_lo, cos_hi, sin_lo, sin_hi, NUM_Q_HEADS, HALF,
                  BLOCK_QH, BLOCK_HALF)
    _rotate_heads(k_ptr + token * stride_kt, stride_kh, cos_lo, cos_hi, sin_lo, sin_hi, NUM_K_HEADS, HALF,
                  BLOCK_KH, BLOCK_HALF)


def apply_rotary(query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> None:
    """Rotate query [T, Hq, D] and key [T, Hkv, D] in place (strided views allowed) by the table rows of
    positions [T]; cos_sin is [max_positions, 2 * D] as built by RotaryEmbedding."""
    num_tokens, num_q_heads, head_dim = query.shape
    if key.dim() != 3 or key.shape[0] != num_tokens or key.shape[2] != head_dim or head_dim % 2:
        raise ValueError(f"query {tuple(query.shape)} and key {tuple(key.shape)} must be [T, heads, D] with the "
                         "same T and an even D")
    if cos_sin.shape[1:] != (2 * head_dim,) or positions.shape != (num_tokens,):
        raise ValueError(f"cos_sin must be [max_positions, {2 * head_dim}] and positions [{num_tokens}]; got "
                         f"{tuple(cos_sin.shape)} and {tuple(positions.shape)}")
    if query.dtype != key.dtype or any(t.stride(-1) != 1 for t in (query, key, cos_sin)):
        raise ValueError(f"query ({query.dtype}) and key ({key.dtype}) must share a dtype, and query, key and "
                         "cos_sin need a contiguous last dim")
    if num_tokens == 0:
        return
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        query, key, positions, cos_sin, query.stride(0), query.stride(1), key.stride(0), key.stride(1),
        cos_sin.stride(0), NUM_Q_HEADS=num_q_heads, NUM_K_HEADS=key.shape[1], HALF=half,
        BLOCK_QH=triton.next_power_of_2(num_q_heads), BLOCK_KH=triton.next_power_of_2(key.shape[1]),
        BLOCK_HALF=triton.next_power_of_2(half))
