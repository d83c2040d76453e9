"""The LLaMA family (Llama 2/3/3.1, Mistral, Phi-3, Qwen2, Qwen3, SmolLM2): one implementation over a flat token
batch.

Q/K/V are fused into one projection and gate/up into another at load time (Phi-3 checkpoints store them fused
already, in the same order); the batch is the
concatenation of every scheduled sequence's new tokens (no padding, no prefill/decode split).
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from fasterllm.config import ModelConfig
from fasterllm.layers.activation import SiluAndMul
from fasterllm.config import KVCacheSpec
from fasterllm.layers.attention import AttentionMetadata
from fasterllm.layers.attention_layer import Attention
from fasterllm.layers.linear import pack_linears
from fasterllm.layers.norm import RMSNorm
from fasterllm.layers.rotary import RotaryEmbedding, rope_inv_freq


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        heads = cfg.num_attention_heads + 2 * cfg.num_key_value_heads
        q_size, kv_size = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.qkv_proj = nn.Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.attention_bias)
        self.qkv_shape = (heads, cfg.head_dim)
        self.num_q_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        if cfg.qk_norm:  # Qwen3: each head's query and key normalised before RoPE
            self.q_norm, self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps), RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.attn = Attention(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.sliding_window)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.act = SiluAndMul()
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                rope: torch.Tensor | tuple[torch.Tensor, torch.Tensor], kv_cache: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.input_layernorm(hidden, residual)  # W8A8 / FP8: quantized rows, not a tensor
        qkv = self.qkv_proj(hidden).view(-1, *self.qkv_shape)
        if self.q_norm is not None:
            qkv = self._norm_heads(qkv)
        attention = self.attn(qkv, rope, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(self.o_proj(attention), residual)
        return self.down_proj(self.act(self.gate_up_proj(hidden))), residual

    def _norm_heads(self, qkv: torch.Tensor) -> torch.Tensor:
        """The query heads through q_norm and the key heads through k_norm, the value heads as they are."""
        q, k, v = qkv.split([self.num_q_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        head_dim = qkv.shape[-1]
        q = self.q_norm(q.reshape(-1, head_dim))[0].view(q.shape)
        k = self.k_norm(k.reshape(-1, head_dim))[0].view(k.shape)
        return torch.cat([q, k, v], dim=1)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int, device: torch.device, dtype: torch.dtype):
        super().__init__()
        self.config = cfg
        with torch.device("meta"):  # allocate once, below, without a random init
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
            self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.to(dtype).to_empty(device=device).requires_grad_(False)
        inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.rope_freq_factors)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, inv_freq, device, dtype)

    def head_as_linear(self) -> None:
        """Make the output head an nn.Linear module, so CPU packing, quantization and the GPU's matrix-vector
        layers replace it like the projections: a tied head gets one over the embedding table's weight (the
        table keeps its rows for lookups; the replacement makes the head's own copy or view)."""
        if self.lm_head is None:
            self.lm_head = nn.Linear(self.config.hidden_size, self.config.vocab_size, bias=False, device="meta")
            self.lm_head.weight = self.embed_tokens.weight

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        """What each layer caches, in layer order."""
        return [layer.attn.kv_spec for layer in self.layers]

    def pack_for_cpu(self) -> None:
        """Reorder every projection's weight (and the head's, once head_as_linear made it a Linear) for oneDNN."""
        pack_linears(self)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: torch.Tensor,
                meta: AttentionMetadata, logits_indices: torch.Tensor) -> torch.Tensor:
        """Flat batch of new tokens -> fp32 logits of the rows in logits_indices only."""
        hidden = self.hidden_states(input_ids, positions, kv_caches, meta, logits_indices)
        logits = F.linear(hidden, self.embed_tokens.weight) if self.lm_head is None else self.lm_head(hidden)
        return logits.float()

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: torch.Tensor | None,
                      meta: AttentionMetadata, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Flat batch of new tokens -> the final norm's output (what the output head reads) at `rows`, or at
        every row when None. kv_caches=None: no cache (torch path only, every sequence a whole prompt)."""
        hidden = self.embed_tokens(input_ids)
        rope = self.rotary.cos_sin if meta.kernel is not None else self.rotary.cos_sin_for(positions)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches if kv_caches is not None else [None] * len(self.layers)):
            hidden, residual = layer(hidden, residual, rope, kv_cache, meta)
        if rows is not None:
            hidden, residual = hidden[rows], residual[rows]
        return self.norm(hidden, residual)[0]

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (Hugging Face names) in, fusing q/k/v and gate/up as they arrive."""
        cfg = self.config
        q_size, kv_size = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        fused = {"q_proj": ("qkv_proj", 0, q_size), "k_proj": ("qkv_proj", q_size, kv_size),
                 "v_proj": ("qkv_proj", q_size + kv_size, kv_size),
                 "gate_proj": ("gate_up_proj", 0, cfg.intermediate_size),
                 "up_proj": ("gate_up_proj", cfg.intermediate_size, cfg.intermediate_size)}
        fused_names = {new for new, _, _ in fused.values()}
        params = dict(self.named_parameters())
        expected = set()
        for pname in params:
            kind = pname.split(".")[-2]
            starts = [start for new, start, _ in fused.values() if new == kind]
            if starts:
                expected.update(f"{pname}#{start}" for start in starts)
            else:
                expected.add(pname)
        loaded = set()
        for name, tensor in weights:
            target, rows = _our_name(name), None
            if target.endswith(".rotary_emb.inv_freq") or (target == "lm_head.weight" and self.lm_head is None):
                continue  # a RoPE table we compute, or a copy of the tied embedding
            parts = target.split(".")
            if len(parts) >= 2 and parts[-2] in fused:
                new, start, size = fused[parts[-2]]
                target, rows = ".".join(parts[:-2] + [new, parts[-1]]), (start, size)
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} does not belong to a {cfg.architecture} "
                                 "with this config; the checkpoint and its config disagree")
            param = params[target]
            dest = param if rows is None else param.narrow(0, *rows)
            if dest.shape != tensor.shape:
                raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)} but the config "
                                 f"implies {tuple(dest.shape)}; the checkpoint and its config disagree")
            dest.copy_(tensor)
            if rows is None and parts[-2] in fused_names:  # stored fused already (Phi-3)
                loaded.update(part for part in expected if part.startswith(f"{target}#"))
            else:
                loaded.add(target if rows is None else f"{target}#{rows[0]}")
        missing = expected - loaded
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}; "
                             "the file is incomplete or for another architecture")


def _our_name(hf_name: str) -> str:
    """Hugging Face parameter name -> ours (before q/k/v and gate/up fusion)."""
    name = hf_name.removeprefix("model.")
    for hf_part, ours in ((".self_attn.o_proj.", ".o_proj."), (".mlp.down_proj.", ".down_proj."),
                          (".self_attn.", "."), (".mlp.", ".")):
        name = name.replace(hf_part, ours)
    return name
