"""What an fp8 KV cache holds (kv_cache_dtype="fp8"): e4m3 values of K / k_scale and V / v_scale, saturated at
+-448, rounded to nearest even. The torch form, for the CPU path and the kernels' references (no Triton here: the
CPU install has none); kernels/kv_store.py's to_cache_values is the same in Triton."""
from __future__ import annotations

import torch

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value


def cache_values(x: torch.Tensor, scale: float, cache_dtype: torch.dtype) -> torch.Tensor:
    """x as a cache of cache_dtype holds it: x / scale in e4m3 for an fp8 cache, else x in cache_dtype."""
    if cache_dtype == FP8_KV_DTYPE:
        return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_KV_DTYPE)
    return x.to(cache_dtype)


def read_back(x: torch.Tensor, scale: float, cache_dtype: torch.dtype) -> torch.Tensor:
    """x as attention reads it back from a cache of cache_dtype: through e4m3 and times the scale for an fp8 cache
    (in x's dtype, as the torch path widens the cache), else x itself."""
    if cache_dtype != FP8_KV_DTYPE:
        return x
    return cache_values(x, scale, cache_dtype).to(x.dtype) * scale
