"""KV-cache store by slot mapping (Triton): each new token's K and V rows go to their cache slots.

One program per token writes all its KV heads; slot = block * block_size + offset, and a negative slot
(a padding row of a captured batch) writes nothing. The caches are [num_blocks, block_size, Hkv, D] views
(kv_cache[layer, 0] and kv_cache[layer, 1]); key/value may be strided views of the fused QKV output.

An fp8 cache holds K / k_scale and V / v_scale as layers/kv_cache_dtype.py says (to_cache_values); the attention
kernels multiply the scales back.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fasterllm.kernels.dependent_launch import early_launch, early_start
from fasterllm.kernels.quant_activation import to_quantized
from fasterllm.kernels.triton_target import compiled_for_gpu
from fasterllm.layers.kv_cache_dtype import FP8_KV_DTYPE, cache_values


@triton.jit
def to_cache_values(x, scale, cache_dtype: tl.constexpr, CAST_ROUNDS: tl.constexpr):
    """K or V values as the cache holds them: as they are, or x / scale on the e4m3 grid for an fp8 cache."""
    if cache_dtype == tl.float8e4nv:
        out = to_quantized(x.to(tl.float32), 1.0 / scale, 448.0, cache_dtype, CAST_ROUNDS)  # FP8_MAX
    else:
        out = x.to(cache_dtype)
    return out


@triton.jit
def _store_kv_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale, v_scale,
                     stride_kt, stride_kh, stride_vt, stride_vh, stride_kb, stride_ks, stride_kch,
                     stride_vb, stride_vs, stride_vch,
                     NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                     BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, CAST_ROUNDS: tl.constexpr, PDL: tl.constexpr):
    early_start(PDL)
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
        heads = tl.arange(0, BLOCK_H)[:, None]
        dims = tl.arange(0, BLOCK_D)[None, :]
        mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
        cache_dtype: tl.constexpr = k_cache_ptr.dtype.element_ty
        k = to_cache_values(tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask), k_scale,
                            cache_dtype, CAST_ROUNDS)
        v = to_cache_values(tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask), v_scale,
                            cache_dtype, CAST_ROUNDS)
        tl.store(k_cache_ptr + block * stride_kb + offset * stride_ks + heads * stride_kch + dims, k, mask=mask)
        tl.store(v_cache_ptr + block * stride_vb + offset * stride_vs + heads * stride_vch + dims, v, mask=mask)


def check_store_args(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     slot_mapping: torch.Tensor) -> None:
    if key.shape != value.shape or key.dim() != 3:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must both be [T, Hkv, D]")
    if key_cache.shape != value_cache.shape or key_cache.shape[2:] != key.shape[1:]:
        raise ValueError(f"key_cache {tuple(key_cache.shape)} and value_cache {tuple(value_cache.shape)} must "
                         f"both be [num_blocks, block_size, {key.shape[1]}, {key.shape[2]}] to hold key/value")
    if slot_mapping.shape != key.shape[:1] or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be [T={key.shape[0]}] int32/int64, got {tuple(slot_mapping.shape)} "
                         f"{slot_mapping.dtype}")
    if key.dtype != value.dtype or key_cache.dtype != value_cache.dtype or \
            key_cache.dtype not in (key.dtype, FP8_KV_DTYPE):
        raise ValueError(f"key/value ({key.dtype}, {value.dtype}) and caches ({key_cache.dtype}, "
                         f"{value_cache.dtype}) must share a dtype, or the caches be {FP8_KV_DTYPE}")
    if any(t.stride(-1) != 1 for t in (key, value, key_cache, value_cache)):
        raise ValueError("key, value and the caches need a contiguous head dim (stride 1)")


def store_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Write key/value [T, Hkv, D] into the caches at slot_mapping [T]; slots < 0 are skipped. The scales divide
    K and V on their way into an fp8 cache (unused otherwise)."""
    check_store_args(key, value, key_cache, value_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, key.stride(0), key.stride(1),
        value.stride(0), value.stride(1), *key_cache.stride()[:3], *value_cache.stride()[:3],
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_SIZE=key_cache.shape[1], CAST_ROUNDS=compiled_for_gpu(key),
        **early_launch(key.device))


def store_kv_reference(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                       slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """The same store in plain torch (fp8 caches written through byte views: torch's CPU indexing has no fp8
    kernels)."""
    check_store_args(key, value, key_cache, value_cache, slot_mapping)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    block_size = key_cache.shape[1]
    for cache, x, scale in ((key_cache, key, k_scale), (value_cache, value, v_scale)):
        cache.view(torch.uint8)[slots // block_size, slots % block_size] = \
            cache_values(x[keep], scale, cache.dtype).view(torch.uint8)
