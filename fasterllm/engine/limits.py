"""The context length the generate and embedding engines allow, and the KV cache it needs (prompt checks:
input_processor.py)."""
from __future__ import annotations

import torch

from fasterllm.config import CacheConfig


def resolve_max_model_len(requested: int | None, default: int, limit: int, limit_name: str) -> int:
    """max_model_len as asked (default when not asked); more than the model's limit positions is an error that
    names the limit as limit_name ("max_position_embeddings=8192", "512 positions")."""
    if requested is None:
        return default
    if requested > limit:
        raise ValueError(f"max_model_len={requested} exceeds the model's {limit_name}; use max_model_len <= {limit}")
    return requested


def check_kv_cache_fits(cache: CacheConfig, max_model_len: int, device: torch.device) -> None:
    """One request of max_model_len tokens must fit the KV cache, or the engine could never run it."""
    needed = -(-max_model_len // cache.block_size)
    if cache.num_blocks >= needed:
        return
    fix = "raise gpu_memory_utilization" if device.type == "cuda" else "raise cpu_kv_cache_gib (--cpu-kv-cache-gib)"
    raise ValueError(
        f"The KV cache has {cache.num_blocks} blocks ({cache.num_blocks * cache.block_size} tokens) but one request "
        f"of max_model_len={max_model_len} needs {needed} blocks. Lower max_model_len (--max-model-len) "
        f"to at most {cache.num_blocks * cache.block_size}, or {fix}.")
