"""The attention layer a model calls: rotary + KV store + paged attention over a fused QKV, on whichever path
the step's metadata says (the Triton kernels on a GPU, the torch path elsewhere), and what the layer caches.

Models build one Attention per layer and never branch on the device: the path is the metadata's
(AttentionMetadata.kernel is set when the inputs were staged for the kernels). Each layer declares its KVCacheSpec,
which the runner reads to size and lay out the KV cache. kv_scales (k_scale, v_scale) divide K and V on their way
into an fp8 cache (kv_cache_dtype="fp8") and multiply them back when read: 1.0 unless set, as vLLM does for
checkpoints that carry none.
"""
from __future__ import annotations

import torch
from torch import nn

from fasterllm.config import KVCacheSpec
from fasterllm.kernels.native import cpu_attention
from fasterllm.layers.attention import (
    AttentionMetadata,
    attend_with_kernels,
    cross_attend_with_kernels,
    paged_attention,
    store_kv,
)
from fasterllm.layers.norm import RMSNorm
from fasterllm.layers.rotary import apply_rotary


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, sliding_window: int | None = None,
                 scale: float | None = None, softcap: float | None = None):
        """scale: of the scores, head_dim ** -0.5 unless given (T5: 1). sliding_window: this layer's (layers of one
        model may differ). softcap: scores capped to softcap * tanh(score / softcap) before the mask (Gemma 2)."""
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.sliding_window, self.softcap = sliding_window, softcap
        kind = "full" if sliding_window is None else "sliding_window"
        self.kv_spec = KVCacheSpec(kind, num_kv_heads, head_dim, sliding_window)
        self.kv_scales = (1.0, 1.0)

    def forward(self, qkv: torch.Tensor, rope: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None,
                kv_cache: torch.Tensor | None, meta: AttentionMetadata,
                head_norms: tuple[RMSNorm, RMSNorm] | None = None) -> torch.Tensor:
        """qkv [T, Hq + 2 Hkv, D] (queries, keys, values of the new tokens, before RoPE) -> [T, Hq * D].
        rope: the whole cos/sin table (kernels) or this step's (cos, sin) rows (torch path); None: no rotary
        positions (the model adds its positions to the embeddings; torch path only). kv_cache None: a
        pass without a cache (embeddings: whole prompts, nothing kept; torch path only). head_norms: per-head
        RMSNorms of the queries and keys before RoPE (Qwen3), inside the rotary launch on the kernel path."""
        if head_norms is not None and (meta.kernel is None or rope is None):  # else inside the rotary launch
            qkv, head_norms = norm_heads(qkv, *head_norms, self.num_heads, self.num_kv_heads), None
        if meta.kernel is not None:
            norms = None if head_norms is None else (head_norms[0].weight, head_norms[1].weight, head_norms[0].eps)
            return attend_with_kernels(qkv, self.num_heads, self.num_kv_heads, kv_cache, meta, rope, self.scale,
                                       self.sliding_window, self.softcap, self.kv_scales, norms)
        stored = False
        if (rope is not None and kv_cache is not None and not meta.prefills
                and cpu_attention.rotary_store_runs(qkv, rope, kv_cache)):
            cpu_attention.rotary_store(qkv, *rope, kv_cache, meta.slot_mapping, self.num_heads)  # a decode batch
            stored = True
        elif rope is not None:  # Q and K rotated together in one call, in place: K then V stay side by side
            qk = qkv[:, :self.num_heads + self.num_kv_heads]
            apply_rotary(qk, *rope, out=qk)
        query, key, value = qkv.split_with_sizes([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        if kv_cache is not None and not stored:
            store_kv(kv_cache, qkv[:, self.num_heads:], meta.slot_mapping, self.kv_scales)
        return paged_attention(query, key, value, kv_cache, meta.for_window(self.sliding_window), self.scale,
                               self.softcap, self.kv_scales)


def norm_heads(qkv: torch.Tensor, q_norm: RMSNorm, k_norm: RMSNorm, num_q_heads: int, num_kv_heads: int
               ) -> torch.Tensor:
    """qkv [T, Hq + 2 Hkv, D] with the query heads through q_norm and the key heads through k_norm (per head, or all
    heads at once where a norm is that wide: OLMoE), the value heads as they are."""
    q, k, v = qkv.split([num_q_heads, num_kv_heads, num_kv_heads], dim=1)
    q = q_norm(q.reshape(-1, q_norm.weight.shape[0]))[0].view(q.shape)
    k = k_norm(k.reshape(-1, k_norm.weight.shape[0]))[0].view(k.shape)
    return torch.cat([q, k, v], dim=1)


class CrossAttention(nn.Module):
    """The decoder's new tokens attending to the encoder's output (encoder-decoder models): all of it, no mask, no
    positions. Its keys and values are computed once per request, when the encoder runs, and stored in the
    request's cross blocks (store); every step reads them back through meta.cross."""

    def __init__(self, num_heads: int, head_dim: int, scale: float | None = None):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.kv_spec = KVCacheSpec("cross", num_heads, head_dim)
        self.kv_scales = (1.0, 1.0)

    def store(self, key_value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """key_value [T_enc, 2 H D]: the encoder tokens' keys then values (a fused K/V projection's output), into
        their cross slots."""
        store_kv(kv_cache, key_value.view(-1, 2 * self.num_heads, self.head_dim), slot_mapping, self.kv_scales)

    def forward(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """query [T, H, D] -> [T, H * D]."""
        if meta.cross.kernel is not None:
            return cross_attend_with_kernels(query, kv_cache, meta.cross.kernel, self.scale, self.kv_scales)
        return paged_attention(query, None, None, kv_cache, meta.cross, self.scale, kv_scales=self.kv_scales)
