"""T5 (v1.0, v1.1 / Flan-T5 shapes) through the paged engine, as models/bart.py runs the BART family: encode() once
per request (packed inputs, every decoder layer's cross K/V stored in the request's cross blocks), forward() every
step over a flat batch of new decoder tokens.

T5 differs from BART in four ways, each handled here: no position embeddings but a learned bias per head and
relative-distance bucket added to the attention scores (bidirectional buckets in the encoder, causal ones in the
decoder; computed once per step and shared by all layers, AttentionMetadata.add_position_bias); unscaled scores;
pre-norm RMS-style norms without biases; an FFN that may be gated (v1.1). On a GPU the decoder's self-attention
takes its bias in the Triton paged kernel, from a table of the bias of each distance back (causal_bias_table); the
encoder's bidirectional bias runs through SDPA (the varlen kernel takes none).
"""
from __future__ import annotations

import math
import re
from collections.abc import Iterable

import torch
from torch import nn

from fasterllm.config import KVCacheSpec
from fasterllm.layers.activation import TORCH_ACTIVATIONS, act_and_mul
from fasterllm.layers.attention import AttentionMetadata
from fasterllm.layers.attention_layer import Attention, CrossAttention
from fasterllm.layers.linear import pack_linears
from fasterllm.layers.norm import RMSNorm
from fasterllm.layers.varlen_attention import VarlenBatch, varlen_attention
from fasterllm.models.checkpoint_copier import CheckpointCopier
from fasterllm.seq2seq_config import T5Config


def relative_position_bucket(relative: torch.Tensor, bidirectional: bool, num_buckets: int,
                             max_distance: int) -> torch.Tensor:
    """T5's bucket of each (key - query) distance: exact for short ones, logarithmic up to max_distance; a causal
    stack (bidirectional=False) buckets only the distances to earlier keys."""
    buckets = torch.zeros_like(relative)
    if bidirectional:
        num_buckets //= 2
        buckets += (relative > 0).long() * num_buckets
        distance = relative.abs()
    else:
        distance = (-relative).clamp(min=0)
    max_exact = num_buckets // 2
    large = max_exact + (torch.log(distance.float() / max_exact) / math.log(max_distance / max_exact)
                         * (num_buckets - max_exact)).long()
    return buckets + torch.where(distance < max_exact, distance, large.clamp(max=num_buckets - 1))


class FeedForward(nn.Module):
    def __init__(self, cfg: T5Config):
        super().__init__()
        self.gated, self.activation = cfg.gated_ffn, cfg.activation
        self.wi = nn.Linear(cfg.hidden_size, (2 if cfg.gated_ffn else 1) * cfg.ffn_dim, bias=False)  # gate, up
        self.wo = nn.Linear(cfg.ffn_dim, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.wi(x)
        if self.gated:  # one launch on a GPU
            return self.wo(act_and_mul(hidden, self.activation))
        return self.wo(TORCH_ACTIVATIONS[self.activation](hidden))


class EncoderLayer(nn.Module):
    def __init__(self, cfg: T5Config):
        super().__init__()
        inner = cfg.num_heads * cfg.head_dim
        self.num_heads = cfg.num_heads
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.layer_norm_eps)
        self.qkv_proj = nn.Linear(cfg.hidden_size, 3 * inner, bias=False)
        self.o_proj = nn.Linear(inner, cfg.hidden_size, bias=False)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.layer_norm_eps)
        self.ffn = FeedForward(cfg)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, batch: VarlenBatch,
                bias) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.attn_norm(hidden, residual)
        hidden = self.o_proj(varlen_attention(self.qkv_proj(hidden), batch, self.num_heads, scale=1.0, bias=bias))
        hidden, residual = self.ffn_norm(hidden, residual)
        return self.ffn(hidden), residual


class DecoderLayer(nn.Module):
    def __init__(self, cfg: T5Config):
        super().__init__()
        inner, heads = cfg.num_heads * cfg.head_dim, cfg.num_heads
        self.num_heads, self.head_dim = heads, cfg.head_dim
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.layer_norm_eps)
        self.qkv_proj = nn.Linear(cfg.hidden_size, 3 * inner, bias=False)
        self.self_attn = Attention(heads, heads, cfg.head_dim, scale=1.0)
        self.o_proj = nn.Linear(inner, cfg.hidden_size, bias=False)
        self.cross_norm = RMSNorm(cfg.hidden_size, cfg.layer_norm_eps)
        self.cross_q_proj = nn.Linear(cfg.hidden_size, inner, bias=False)
        self.cross_kv_proj = nn.Linear(cfg.hidden_size, 2 * inner, bias=False)
        self.cross_attn = CrossAttention(heads, cfg.head_dim, scale=1.0)
        self.cross_o_proj = nn.Linear(inner, cfg.hidden_size, bias=False)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.layer_norm_eps)
        self.ffn = FeedForward(cfg)

    def store_cross(self, encoder_hidden: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        self.cross_attn.store(self.cross_kv_proj(encoder_hidden), kv_cache, slot_mapping)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        heads, head_dim = self.num_heads, self.head_dim
        hidden, residual = self.attn_norm(hidden, residual)
        qkv = self.qkv_proj(hidden).view(-1, 3 * heads, head_dim)
        hidden, residual = self.cross_norm(self.o_proj(self.self_attn(qkv, None, kv_cache, meta)), residual)
        query = self.cross_q_proj(hidden).view(-1, heads, head_dim)
        hidden, residual = self.ffn_norm(self.cross_o_proj(self.cross_attn(query, kv_cache, meta)), residual)
        return self.ffn(hidden), residual


class T5Stack(nn.Module):
    def __init__(self, cfg: T5Config, layers: list[nn.Module], causal: bool):
        super().__init__()
        self.config, self.causal = cfg, causal
        self.relative_bias = nn.Embedding(cfg.num_buckets, cfg.num_heads)
        self.layers = nn.ModuleList(layers)
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.layer_norm_eps)

    def position_bias(self, query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
        """[heads, q, k] of the learned bias of each query-key distance's bucket."""
        cfg = self.config
        buckets = relative_position_bucket(key_positions[None, :] - query_positions[:, None], not self.causal,
                                           cfg.num_buckets, cfg.max_distance)
        return self.relative_bias(buckets).permute(2, 0, 1)

    def causal_bias_table(self) -> torch.Tensor:
        """[max_distance + 1, heads]: row d is the bias of a key d positions back (every longer distance shares the
        last row's bucket), the form the Triton kernels read."""
        distances = torch.arange(self.config.max_distance + 1, device=self.relative_bias.weight.device)
        return self.position_bias(distances, torch.zeros_like(distances[:1]))[:, :, 0].t().contiguous()


class T5ForConditionalGeneration(nn.Module):
    """Encoder-decoder over flat token batches: encode() once per request, forward() every step."""

    # its encoder's attention (with the relative-position bias) runs SDPA per run of equal lengths: a graph would
    # keep the lengths it was captured with
    replayable_encoder = False

    def __init__(self, cfg: T5Config, max_positions: int, device: torch.device, dtype: torch.dtype):
        super().__init__()
        self.config = cfg
        with torch.device("meta"):  # allocate once, below, without a random init
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
            self.encoder = T5Stack(cfg, [EncoderLayer(cfg) for _ in range(cfg.encoder_layers)], causal=False)
            self.decoder = T5Stack(cfg, [DecoderLayer(cfg) for _ in range(cfg.decoder_layers)], causal=True)
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.to(dtype).to_empty(device=device).requires_grad_(False)
        self.output_scale = cfg.hidden_size ** -0.5 if cfg.scale_decoder_outputs else 1.0
        self.tied_head = True  # until load_weights finds a head of the checkpoint's own
        self.bias_table: torch.Tensor | None = None  # the decoder's, for the kernels: made on the first GPU step

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        """The decoder's self-attention layers, then its cross-attention layers (a second cache group)."""
        layers = self.decoder.layers
        return [layer.self_attn.kv_spec for layer in layers] + [layer.cross_attn.kv_spec for layer in layers]

    def head_as_linear(self) -> None:
        """The head is a Linear already; a tied one (no lm_head in the checkpoint) takes the embedding's weight."""
        if self.tied_head:
            self.lm_head.weight = self.embed_tokens.weight

    def pack_for_cpu(self) -> None:
        pack_linears(self)

    def encode(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: VarlenBatch, kv_caches: torch.Tensor,
               slot_mapping: torch.Tensor) -> None:
        """Packed encoder inputs -> every decoder layer's cross-attention K/V, stored at slot_mapping."""
        biases: dict[int, torch.Tensor] = {}

        def bias(length: int) -> torch.Tensor:  # one per distinct length in the batch, shared by all layers
            if length not in biases:
                keys = torch.arange(length, device=input_ids.device)
                biases[length] = self.encoder.position_bias(keys, keys)
            return biases[length]

        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.encoder.layers:
            hidden, residual = layer(hidden, residual, batch, bias)
        hidden = self.encoder.final_norm(hidden, residual)[0]
        for layer, kv_cache in zip(self.decoder.layers, kv_caches):
            layer.store_cross(hidden, kv_cache, slot_mapping)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: torch.Tensor,
                meta: AttentionMetadata, logits_indices: torch.Tensor) -> torch.Tensor:
        """Flat batch of new decoder tokens -> fp32 logits of the rows in logits_indices only."""
        if meta.kernel is None:
            meta.add_position_bias(self.decoder.position_bias)
        else:  # before any CUDA graph is captured: the first forward is an eager one
            if self.bias_table is None:
                self.bias_table = self.decoder.causal_bias_table()
            meta.kernel.position_bias = self.bias_table
        hidden, residual = self.embed_tokens(input_ids), None
        for layer, kv_cache in zip(self.decoder.layers, kv_caches):
            hidden, residual = layer(hidden, residual, kv_cache, meta)
        hidden = self.decoder.final_norm(hidden[logits_indices], residual[logits_indices])[0]
        return self.lm_head(hidden * self.output_scale).float()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (Hugging Face names) in, fusing q/k/v, the cross k/v and a gated FFN's two inputs."""
        copier = CheckpointCopier(self, self.config.architecture, _PARTS)
        for hf_name, tensor in weights:
            ours = _our_name(hf_name)
            if ours is not None:
                copier.copy(hf_name, *ours, tensor)
        self.tied_head = not copier.has("lm_head.weight")
        copier.check_complete({"lm_head.weight"} if self.tied_head else set())


_PARTS = {"qkv_proj": 3, "cross_kv_proj": 2, "wi": 2}  # fused projections: how many checkpoint tensors each holds
_RULES = [  # Hugging Face name pattern -> ours, and which part of a fused projection (None: the whole tensor)
    (r"(encoder|decoder)\.block\.(\d+)\.layer\.0\.SelfAttention\.([qkv])\.weight", r"\1.layers.\2.qkv_proj.weight",
     "qkv"),
    (r"(encoder|decoder)\.block\.(\d+)\.layer\.0\.SelfAttention\.o\.weight", r"\1.layers.\2.o_proj.weight", None),
    (r"(encoder|decoder)\.block\.0\.layer\.0\.SelfAttention\.relative_attention_bias\.weight",
     r"\1.relative_bias.weight", None),
    (r"(encoder|decoder)\.block\.(\d+)\.layer\.0\.layer_norm\.weight", r"\1.layers.\2.attn_norm.weight", None),
    (r"decoder\.block\.(\d+)\.layer\.1\.EncDecAttention\.q\.weight", r"decoder.layers.\1.cross_q_proj.weight", None),
    (r"decoder\.block\.(\d+)\.layer\.1\.EncDecAttention\.([kv])\.weight", r"decoder.layers.\1.cross_kv_proj.weight",
     "kv"),
    (r"decoder\.block\.(\d+)\.layer\.1\.EncDecAttention\.o\.weight", r"decoder.layers.\1.cross_o_proj.weight", None),
    (r"decoder\.block\.(\d+)\.layer\.1\.layer_norm\.weight", r"decoder.layers.\1.cross_norm.weight", None),
    (r"(encoder|decoder)\.block\.(\d+)\.layer\.[12]\.DenseReluDense\.wi\.weight", r"\1.layers.\2.ffn.wi.weight", None),
    (r"(encoder|decoder)\.block\.(\d+)\.layer\.[12]\.DenseReluDense\.wi_([01])\.weight", r"\1.layers.\2.ffn.wi.weight",
     "01"),
    (r"(encoder|decoder)\.block\.(\d+)\.layer\.[12]\.DenseReluDense\.wo\.weight", r"\1.layers.\2.ffn.wo.weight", None),
    (r"(encoder|decoder)\.block\.(\d+)\.layer\.[12]\.layer_norm\.weight", r"\1.layers.\2.ffn_norm.weight", None),
    (r"(encoder|decoder)\.final_layer_norm\.weight", r"\1.final_norm.weight", None),
    (r"shared\.weight", "embed_tokens.weight", None),
    (r"lm_head\.weight", "lm_head.weight", None),
]
_COMPILED = [(re.compile(pattern + "$"), replacement, parts) for pattern, replacement, parts in _RULES]
# copies of the shared table, and a bias transformers' cross-attention never reads
_SKIPPED = re.compile(r"^((encoder|decoder)\.embed_tokens\.weight|decoder\.block\.0\.layer\.1\.EncDecAttention\."
                      r"relative_attention_bias\.weight)$")


def _our_name(hf_name: str) -> tuple[str, int | None] | None:
    if _SKIPPED.match(hf_name):
        return None
    for pattern, replacement, parts in _COMPILED:
        match = pattern.match(hf_name)
        if match:
            return match.expand(replacement), None if parts is None else parts.index(match.groups()[-1])
    return hf_name, None  # not ours: load_weights names it
