"""Rotary position embedding on Q and K in one launch (Triton), in place, one program per token;
optionally fused with the KV-cache store (rotary_and_store_kv: one launch instead of two per layer) and with
per-head RMSNorms of Q and K before the rotation (Qwen3, Gemma 3: three launches fewer per layer: the two norms and
the concatenation of their outputs).

The table is RotaryEmbedding.cos_sin: row p = [cos, cos, -sin, sin] (each D/2 wide; frequency scalings
such as llama3's are already inside it). Rounding follows fasterllm.layers.rotary.apply_rotary, the
reference: out = round(round(x * cos) + swap_halves(x) * sin), the product-sum in fp32. The fused store
writes the very values written back to K (and V as is) to the slots of kv_store.store_kv. The fused norms round
as kernels/rms_norm.py (layers/norm.RMSNorm's reference): round(round(x * rstd) * weight).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fasterllm.kernels.dependent_launch import early_launch, early_start
from fasterllm.kernels.kv_store import check_store_args, to_cache_values
from fasterllm.kernels.triton_target import compiled_for_gpu


@triton.jit
def _rotate_heads(x_ptr, stride_h, cos_lo, cos_hi, sin_lo, sin_hi, norm_ptr, norm_eps, NUM_HEADS: tl.constexpr,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, NORM: tl.constexpr):
    """Rotates the token's heads in place (NORM: each head RMS-normalised first, times the weight at norm_ptr);
    returns the rotated halves (in x's dtype) for the cache."""
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < NUM_HEADS) & (dims < HALF)
    lo_ptrs = x_ptr + heads * stride_h + dims
    lo = tl.load(lo_ptrs, mask=mask, other=0.0)
    hi = tl.load(lo_ptrs + HALF, mask=mask, other=0.0)
    dtype = lo.dtype
    if NORM:
        lo32, hi32 = lo.to(tl.float32), hi.to(tl.float32)
        squares = tl.sum(lo32 * lo32, axis=1) + tl.sum(hi32 * hi32, axis=1)
        rstd = (1.0 / tl.sqrt(squares / (2 * HALF) + norm_eps))[:, None]
        w_lo = tl.load(norm_ptr + dims, mask=dims < HALF, other=0.0).to(tl.float32)
        w_hi = tl.load(norm_ptr + HALF + dims, mask=dims < HALF, other=0.0).to(tl.float32)
        lo = ((lo32 * rstd).to(dtype).to(tl.float32) * w_lo).to(dtype)
        hi = ((hi32 * rstd).to(dtype).to(tl.float32) * w_hi).to(dtype)
    lo_cos = (lo * cos_lo).to(dtype).to(tl.float32)  # the reference rounds x * cos before adding
    hi_cos = (hi * cos_hi).to(dtype).to(tl.float32)
    new_lo = (lo_cos + hi.to(tl.float32) * sin_lo).to(dtype)
    new_hi = (hi_cos + lo.to(tl.float32) * sin_hi).to(dtype)
    tl.store(lo_ptrs, new_lo, mask=mask)
    tl.store(lo_ptrs + HALF, new_hi, mask=mask)
    return new_lo, new_hi


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, v_ptr, positions_ptr, cos_sin_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale,
                   v_scale, q_norm_ptr, k_norm_ptr, norm_eps, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt,
                   stride_vh, stride_table, table_rows, stride_kb, stride_ks, stride_kch, stride_vb, stride_vs,
                   stride_vch,
                   NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HALF: tl.constexpr,
                   BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_HALF: tl.constexpr,
                   STORE_KV: tl.constexpr, BLOCK_SIZE: tl.constexpr, CAST_ROUNDS: tl.constexpr,
                   NORM: tl.constexpr, PDL: tl.constexpr):
    early_start(PDL)
    token = tl.program_id(0).to(tl.int64)
    # a position past the table (start-up's synthetic batches: a piecewise graph's warm-up is one sequence of up to
    # 512 tokens whatever max_model_len, the table's rows) reads its last row, not the memory after it
    position = tl.minimum(tl.maximum(tl.load(positions_ptr + token).to(tl.int64), 0), table_rows - 1)
    row = cos_sin_ptr + position * stride_table
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = dims < HALF
    cos_lo = tl.load(row + dims, mask=mask, other=0.0).to(tl.float32)
    cos_hi = tl.load(row + HALF + dims, mask=mask, other=0.0).to(tl.float32)
    sin_lo = tl.load(row + 2 * HALF + dims, mask=mask, other=0.0).to(tl.float32)
    sin_hi = tl.load(row + 3 * HALF + dims, mask=mask, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr + token * stride_qt, stride_qh, cos_lo, cos_hi, sin_lo, sin_hi, q_norm_ptr, norm_eps,
                  NUM_Q_HEADS, HALF, BLOCK_QH, BLOCK_HALF, NORM)
    k_lo, k_hi = _rotate_heads(k_ptr + token * stride_kt, stride_kh, cos_lo, cos_hi, sin_lo, sin_hi, k_norm_ptr,
                               norm_eps, NUM_K_HEADS, HALF, BLOCK_KH, BLOCK_HALF, NORM)
    if STORE_KV:
        slot = tl.load(slot_ptr + token).to(tl.int64)
        if slot >= 0:  # a padding row (slot -1) is rotated but stored nowhere
            heads = tl.arange(0, BLOCK_KH)[:, None]
            head_mask = (heads < NUM_K_HEADS) & mask
            k_dst = k_cache_ptr + (slot // BLOCK_SIZE) * stride_kb + (slot % BLOCK_SIZE) * stride_ks \
                + heads * stride_kch + dims
            cache_dtype: tl.constexpr = k_cache_ptr.dtype.element_ty
            tl.store(k_dst, to_cache_values(k_lo, k_scale, cache_dtype, CAST_ROUNDS), mask=head_mask)
            tl.store(k_dst + HALF, to_cache_values(k_hi, k_scale, cache_dtype, CAST_ROUNDS), mask=head_mask)
            v_src = v_ptr + token * stride_vt + heads * stride_vh + dims
            v_dst = v_cache_ptr + (slot // BLOCK_SIZE) * stride_vb + (slot % BLOCK_SIZE) * stride_vs \
                + heads * stride_vch + dims
            for half in tl.static_range(2):
                v_half = tl.load(v_src + half * HALF, mask=head_mask)
                tl.store(v_dst + half * HALF, to_cache_values(v_half, v_scale, cache_dtype, CAST_ROUNDS),
                         mask=head_mask)


def _check_rotary(query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> None:
    num_tokens, _, head_dim = query.shape
    if key.dim() != 3 or key.shape[0] != num_tokens or key.shape[2] != head_dim or head_dim % 2:
        raise ValueError(f"query {tuple(query.shape)} and key {tuple(key.shape)} must be [T, heads, D] with the "
                         "same T and an even D")
    if cos_sin.shape[1:] != (2 * head_dim,) or positions.shape != (num_tokens,):
        raise ValueError(f"cos_sin must be [max_positions, {2 * head_dim}] and positions [{num_tokens}]; got "
                         f"{tuple(cos_sin.shape)} and {tuple(positions.shape)}")
    if query.dtype != key.dtype or any(t.stride(-1) != 1 for t in (query, key, cos_sin)):
        raise ValueError(f"query ({query.dtype}) and key ({key.dtype}) must share a dtype, and query, key and "
                         "cos_sin need a contiguous last dim")


def _launch(query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
            store: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None, k_scale: float = 1.0,
            v_scale: float = 1.0, head_norms: tuple[torch.Tensor, torch.Tensor, float] | None = None) -> None:
    """store: (value, key_cache, value_cache, slot_mapping) for the fused KV store, or None. head_norms: (q weight,
    k weight, eps) of per-head RMSNorms applied before the rotation, or None."""
    num_tokens, num_q_heads, head_dim = query.shape
    if num_tokens == 0:
        return
    half = head_dim // 2
    # without a store the cache arguments are never read: key/positions stand in, strides 0 and block size 1
    # keep the compiled variant independent of the batch
    value, key_cache, value_cache, slot_mapping = store or (key, key, key, positions)
    cache_strides = (*key_cache.stride()[:3], *value_cache.stride()[:3]) if store else (0,) * 6
    q_norm, k_norm, norm_eps = head_norms or (cos_sin, cos_sin, 0.0)  # without norms cos_sin stands in, never read
    _rotary_kernel[(num_tokens,)](
        query, key, value, positions, cos_sin, key_cache, value_cache, slot_mapping, k_scale, v_scale, q_norm, k_norm,
        norm_eps, query.stride(0), query.stride(1), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        cos_sin.stride(0), cos_sin.shape[0], *cache_strides, NUM_Q_HEADS=num_q_heads, NUM_K_HEADS=key.shape[1],
        HALF=half, BLOCK_QH=triton.next_power_of_2(num_q_heads), BLOCK_KH=triton.next_power_of_2(key.shape[1]),
        BLOCK_HALF=triton.next_power_of_2(half), STORE_KV=store is not None,
        BLOCK_SIZE=key_cache.shape[1] if store else 1, CAST_ROUNDS=compiled_for_gpu(key), NORM=head_norms is not None,
        **early_launch(query.device))


def apply_rotary(query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> None:
    """Rotate query [T, Hq, D] and key [T, Hkv, D] in place (strided views allowed) by the table rows of
    positions [T]; cos_sin is [max_positions, 2 * D] as built by RotaryEmbedding."""
    _check_rotary(query, key, positions, cos_sin)
    _launch(query, key, positions, cos_sin, None)


def rotary_and_store_kv(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor,
                        cos_sin: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0,
                        head_norms: tuple[torch.Tensor, torch.Tensor, float] | None = None) -> None:
    """apply_rotary(query, key, positions, cos_sin) then kv_store.store_kv(key, value, key_cache, value_cache,
    slot_mapping, k_scale, v_scale) in one launch: Q and K rotated in place, rotated K and V [T, Hkv, D] written to
    the caches [num_blocks, block_size, Hkv, D] at slot_mapping [T] (slots < 0 skipped; their K is still rotated).
    head_norms (q weight [D], k weight [D], eps): each query and key head RMS-normalised (as layers/norm.RMSNorm
    rounds) before its rotation, in the same launch."""
    _check_rotary(query, key, positions, cos_sin)
    check_store_args(key, value, key_cache, value_cache, slot_mapping)
    if head_norms is not None and any(w.shape != query.shape[2:] or w.dtype != query.dtype for w in head_norms[:2]):
        raise ValueError(f"head_norms' weights {[tuple(w.shape) for w in head_norms[:2]]} must be [head_dim = "
                         f"{query.shape[2]}] in the heads' dtype {query.dtype}")
    _launch(query, key, positions, cos_sin, (value, key_cache, value_cache, slot_mapping), k_scale, v_scale,
            head_norms)
