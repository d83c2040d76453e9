"""DeepSeek-V2 and DeepSeek-V2-Lite: the LLaMA decoder (models/llama.py) with multi-head latent attention in place of
its attention, and DeepSeekMoE (layers/moe.py: softmax routing times routed_scaling_factor, ungated shared experts,
leading dense layers) as its FFN.

Latent attention, as computed here: each token's keys and values are expanded per head from one normed latent
(kv_b_proj), besides one rotated key part every head shares; the cache holds the expanded keys and values (not the
latent), each head's value zero-padded to the key's width so keys and values share the paged layout and kernels.
DeepSeek rotates interleaved pairs (x[2i], x[2i + 1]); the rotated parts are de-interleaved first ([evens, odds]) so
the rotate-half tables and kernels apply, the same permutation on queries and keys leaving their dot products as
they were.
"""
from __future__ import annotations

import torch
from torch import nn

from fasterllm.config import ModelConfig
from fasterllm.distributed.tensor_parallel import TensorParallel
from fasterllm.layers.attention import AttentionMetadata
from fasterllm.layers.attention_layer import Attention
from fasterllm.layers.norm import RMSNorm
from fasterllm.layers.rotary import apply_rotary, yarn_mscale
from fasterllm.models.llama import DecoderLayer, LlamaForCausalLM

# the eps of the q_a and kv_a norms: transformers' RMSNorm default, not the config's rms_norm_eps
LATENT_NORM_EPS = 1e-6


def latent_softmax_scale(cfg: ModelConfig) -> float:
    """1 / sqrt(qk_nope + qk_rope), times YaRN's mscale(factor, mscale_all_dim) squared when the RoPE scaling sets
    mscale_all_dim (DeepSeek-V2: the scores keep their magnitude over the stretched context)."""
    scale = cfg.head_dim ** -0.5
    scaling = cfg.rope_scaling or {}
    if scaling.get("mscale_all_dim"):
        scale *= yarn_mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2
    return scale


def deinterleave(pairs: torch.Tensor) -> torch.Tensor:
    """[..., D] as D / 2 pairs (x[2i], x[2i + 1]) -> [..., D] as [x[0], x[2], ..., x[1], x[3], ...] (a strided view)."""
    return pairs.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


class LatentAttentionDecoderLayer(DecoderLayer):
    def _init_attention(self, cfg: ModelConfig, tp: TensorParallel, index: int) -> None:
        shape = cfg.latent_attention
        heads, hidden = cfg.num_attention_heads, cfg.hidden_size
        self.num_q_heads = self.num_kv_heads = heads
        self.nope_dim, self.rope_dim, self.v_dim = shape.qk_nope_head_dim, shape.qk_rope_head_dim, shape.v_head_dim
        self.kv_lora_rank, self.low_rank_queries = shape.kv_lora_rank, shape.q_lora_rank is not None
        if not self.low_rank_queries:  # V2-Lite: queries straight from the hidden rows
            self.q_proj = nn.Linear(hidden, heads * cfg.head_dim, bias=False)
        else:  # V2: through a low-rank bottleneck, normed in between
            self.q_a_proj = nn.Linear(hidden, shape.q_lora_rank, bias=cfg.attention_bias)
            self.q_a_layernorm = RMSNorm(shape.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(shape.q_lora_rank, heads * cfg.head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, shape.kv_lora_rank + self.rope_dim, bias=cfg.attention_bias)
        self.kv_a_layernorm = RMSNorm(shape.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(shape.kv_lora_rank, heads * (self.nope_dim + self.v_dim), bias=False)
        self.attn = Attention(heads, heads, cfg.head_dim, scale=latent_softmax_scale(cfg))
        self.o_proj = nn.Linear(heads * self.v_dim, hidden, bias=cfg.attention_bias)

    def _queries(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.low_rank_queries:
            return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden))[0])
        return self.q_proj(hidden)

    def _attention(self, hidden: torch.Tensor, rope: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
                   kv_cache: torch.Tensor | None, meta: AttentionMetadata) -> torch.Tensor:
        """The normed rows -> the attention's output heads, o_proj's input. rope: the whole cos/sin table (kernels)
        or this step's (cos, sin) rows (torch path), of the rotated width."""
        heads, nope = self.num_q_heads, self.nope_dim
        queries = self._queries(hidden).view(-1, heads, nope + self.rope_dim)
        latent, shared_key = self.kv_a_proj_with_mqa(hidden).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        keys_values = self.kv_b_proj(self.kv_a_layernorm(latent)[0]).view(-1, heads, nope + self.v_dim)
        # queries, keys and zero-padded values side by side, each head nope + rope wide, as Attention takes them
        qkv = hidden.new_zeros(hidden.shape[0], 3 * heads, nope + self.rope_dim)
        query, key, value = qkv.split(heads, dim=1)
        query[..., :nope] = queries[..., :nope]
        query[..., nope:] = deinterleave(queries[..., nope:])
        rotated_key = deinterleave(shared_key).unsqueeze(1).contiguous()  # [T, 1, rope]: rotated once for all heads
        if meta.kernel is not None:
            from fasterllm.kernels.rotary import apply_rotary as apply_rotary_kernel  # Triton: only with CUDA

            apply_rotary_kernel(query[..., nope:], rotated_key, meta.positions, rope)
        else:
            apply_rotary(query[..., nope:], *rope, out=query[..., nope:])
            apply_rotary(rotated_key, *rope, out=rotated_key)
        key[..., :nope] = keys_values[..., :nope]
        key[..., nope:] = rotated_key
        value[..., :self.v_dim] = keys_values[..., nope:]
        attended = self.attn(qkv, None, kv_cache, meta).view(-1, heads, nope + self.rope_dim)[..., :self.v_dim]
        return attended.reshape(-1, heads * self.v_dim)


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    """One device only: distributed/tensor_parallel.py refuses tensor_parallel_size > 1 for latent attention."""

    decoder_layer = LatentAttentionDecoderLayer
