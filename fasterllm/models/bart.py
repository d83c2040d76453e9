"""The BART family of encoder-decoders (BART, mBART, Marian, M2M100 / NLLB): FasterTransformer's Decoder and Decoding
over the paged engine.

The encoder runs once per request, over the packed inputs of the requests that start in a step (no padding:
the varlen attention of the BERT path), and each decoder layer's cross-attention keys and values are computed
from its output then and stored in the request's cross blocks (encode). The decoder then runs like any decoder
over a flat batch of new tokens: masked self-attention over its paged KV, cross-attention over the cross blocks,
the FFN (forward). Seq2SeqConfig says how the families differ (norm placement, positions, embedding norm, logits
bias).
"""
from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from fasterllm.config import KVCacheSpec
from fasterllm.layers.activation import TORCH_ACTIVATIONS
from fasterllm.layers.attention import AttentionMetadata
from fasterllm.layers.attention_layer import Attention, CrossAttention
from fasterllm.layers.linear import pack_linears
from fasterllm.layers.varlen_attention import VarlenBatch, varlen_attention
from fasterllm.models.checkpoint_copier import CheckpointCopier
from fasterllm.models.seq2seq_cpu_decode import Seq2SeqDecodeStack
from fasterllm.seq2seq_config import Seq2SeqConfig

LEARNED_POSITIONS = ("bart", "mbart")  # the others' positions are fixed sinusoids
LEARNED_POSITION_OFFSET = 2  # BART's learned position table keeps two rows before position 0


def _residual(x: torch.Tensor, norm: nn.LayerNorm, block: Callable[[torch.Tensor], torch.Tensor],
              pre_norm: bool) -> torch.Tensor:
    """x + block(norm(x)) (pre-norm: mBART, M2M100) or norm(x + block(x)) (post-norm: BART, Marian; on a GPU the
    add and the norm are one Triton launch)."""
    if pre_norm:
        return x + block(norm(x))
    if x.is_cuda:
        from fasterllm.kernels.layer_norm import add_bias_residual_layer_norm

        return add_bias_residual_layer_norm(block(x), None, x, norm.weight, norm.bias, norm.eps)
    return norm(x + block(x))


class EncoderLayer(nn.Module):
    def __init__(self, cfg: Seq2SeqConfig):
        super().__init__()
        hidden = cfg.hidden_size
        self.num_heads, self.pre_norm = cfg.encoder_attention_heads, cfg.pre_norm
        self.act = TORCH_ACTIVATIONS[cfg.activation]
        self.qkv_proj = nn.Linear(hidden, 3 * hidden)
        self.out_proj = nn.Linear(hidden, hidden)
        self.self_attn_layer_norm = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, cfg.encoder_ffn_dim)
        self.fc2 = nn.Linear(cfg.encoder_ffn_dim, hidden)
        self.final_layer_norm = nn.LayerNorm(hidden)

    def forward(self, x: torch.Tensor, batch: VarlenBatch) -> torch.Tensor:
        x = _residual(x, self.self_attn_layer_norm,
                      lambda h: self.out_proj(varlen_attention(self.qkv_proj(h), batch, self.num_heads)), self.pre_norm)
        return _residual(x, self.final_layer_norm, lambda h: self.fc2(self.act(self.fc1(h))), self.pre_norm)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Seq2SeqConfig):
        super().__init__()
        hidden, heads = cfg.hidden_size, cfg.decoder_attention_heads
        self.num_heads, self.head_dim = heads, cfg.head_dim
        self.pre_norm, self.act = cfg.pre_norm, TORCH_ACTIVATIONS[cfg.activation]
        self.qkv_proj = nn.Linear(hidden, 3 * hidden)
        self.self_attn = Attention(heads, heads, cfg.head_dim)
        self.out_proj = nn.Linear(hidden, hidden)
        self.self_attn_layer_norm = nn.LayerNorm(hidden)
        self.cross_q_proj = nn.Linear(hidden, hidden)
        self.cross_kv_proj = nn.Linear(hidden, 2 * hidden)  # applied to the encoder's output, once per request
        self.cross_attn = CrossAttention(heads, cfg.head_dim)
        self.cross_out_proj = nn.Linear(hidden, hidden)
        self.encoder_attn_layer_norm = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, cfg.decoder_ffn_dim)
        self.fc2 = nn.Linear(cfg.decoder_ffn_dim, hidden)
        self.final_layer_norm = nn.LayerNorm(hidden)

    def store_cross(self, encoder_hidden: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        self.cross_attn.store(self.cross_kv_proj(encoder_hidden), kv_cache, slot_mapping)

    def forward(self, x: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        heads, head_dim = self.num_heads, self.head_dim
        x = _residual(x, self.self_attn_layer_norm, lambda h: self.out_proj(
            self.self_attn(self.qkv_proj(h).view(-1, 3 * heads, head_dim), None, kv_cache, meta)), self.pre_norm)
        x = _residual(x, self.encoder_attn_layer_norm, lambda h: self.cross_out_proj(
            self.cross_attn(self.cross_q_proj(h).view(-1, heads, head_dim), kv_cache, meta)), self.pre_norm)
        return _residual(x, self.final_layer_norm, lambda h: self.fc2(self.act(self.fc1(h))), self.pre_norm)


class Stack(nn.Module):
    """One side's embeddings (token table, positions, optional LayerNorm), its layers and, pre-norm, its last norm."""

    def __init__(self, cfg: Seq2SeqConfig, layers: list[nn.Module], vocab_size: int | None):
        super().__init__()
        hidden = cfg.hidden_size
        self.embed_scale = cfg.embed_scale
        self.embed_tokens = nn.Embedding(vocab_size, hidden) if vocab_size else None  # None: the decoder's table
        rows = cfg.max_position_embeddings + LEARNED_POSITION_OFFSET
        self.embed_positions = nn.Embedding(rows, hidden) if cfg.model_type in LEARNED_POSITIONS else None
        self.layernorm_embedding = nn.LayerNorm(hidden) if cfg.layernorm_embedding else None
        self.layers = nn.ModuleList(layers)
        self.layer_norm = nn.LayerNorm(hidden) if cfg.pre_norm else None

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor, table: nn.Embedding,
              sinusoids: torch.Tensor | None) -> torch.Tensor:
        """Token rows scaled, plus each position's row (positions count from 0 in each sequence)."""
        x = table(input_ids) * self.embed_scale
        if self.embed_positions is not None:
            x = x + self.embed_positions(positions + LEARNED_POSITION_OFFSET)
        else:
            x = x + sinusoids[positions]
        return x if self.layernorm_embedding is None else self.layernorm_embedding(x)

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.layer_norm is None else self.layer_norm(x)


class BartForConditionalGeneration(nn.Module):
    """Encoder-decoder over flat token batches: encode() once per request, forward() every step."""

    # its encoder attends in one Triton launch over cu_seqlens: a CUDA graph of encode() serves any lengths
    replayable_encoder = True
    # on the CPU: decode steps through all decoder layers in one C++ call where it runs them (use_cpu_decode_stack)
    cpu_decode_stack: Seq2SeqDecodeStack | None = None

    def __init__(self, cfg: Seq2SeqConfig, max_positions: int, device: torch.device, dtype: torch.dtype):
        super().__init__()
        self.config = cfg
        with torch.device("meta"):  # allocate once, below, without a random init
            self.encoder = Stack(cfg, [EncoderLayer(cfg) for _ in range(cfg.encoder_layers)], cfg.encoder_vocab_size)
            self.decoder = Stack(cfg, [DecoderLayer(cfg) for _ in range(cfg.decoder_layers)], cfg.vocab_size)
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=cfg.final_logits_bias)
        self.to(dtype).to_empty(device=device).requires_grad_(False)
        # Marian's and M2M100's positions are fixed sinusoids, computed here (not in the checkpoint)
        self.sinusoids = None if self.decoder.embed_positions is not None else _sinusoids(cfg).to(device, dtype)

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        """The decoder's self-attention layers, then its cross-attention layers (a second cache group)."""
        layers = self.decoder.layers
        return [layer.self_attn.kv_spec for layer in layers] + [layer.cross_attn.kv_spec for layer in layers]

    def head_as_linear(self) -> None:
        """The head is a Linear already (its bias: final_logits_bias); a tied one takes the embedding's weight."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.decoder.embed_tokens.weight

    def pack_for_cpu(self) -> None:
        pack_linears(self)

    def use_cpu_decode_stack(self) -> None:
        """Run CPU decode steps through models/seq2seq_cpu_decode.py where every decoder layer is one it runs."""
        self.cpu_decode_stack = Seq2SeqDecodeStack.of(self)

    def encode(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: VarlenBatch, kv_caches: torch.Tensor,
               slot_mapping: torch.Tensor) -> None:
        """Packed encoder inputs -> every decoder layer's cross-attention K/V, stored at slot_mapping (one slot per
        encoder token, in the requests' cross blocks)."""
        table = self.decoder.embed_tokens if self.encoder.embed_tokens is None else self.encoder.embed_tokens
        hidden = self.encoder.embed(input_ids, positions, table, self.sinusoids)
        for layer in self.encoder.layers:
            hidden = layer(hidden, batch)
        hidden = self.encoder.final_norm(hidden)
        for layer, kv_cache in zip(self.decoder.layers, kv_caches):
            layer.store_cross(hidden, kv_cache, slot_mapping)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: torch.Tensor,
                meta: AttentionMetadata, logits_indices: torch.Tensor) -> torch.Tensor:
        """Flat batch of new decoder tokens -> fp32 logits of the rows in logits_indices only (meta.cross says
        where each sequence's encoder K/V lie)."""
        hidden = self.decoder.embed(input_ids, positions, self.decoder.embed_tokens, self.sinusoids)
        if self.cpu_decode_stack is not None and self.cpu_decode_stack.takes(hidden, kv_caches, meta):
            hidden = self.cpu_decode_stack(hidden, kv_caches, meta)
        else:
            for layer, kv_cache in zip(self.decoder.layers, kv_caches):
                hidden = layer(hidden, kv_cache, meta)
        return self.lm_head(self.decoder.final_norm(hidden[logits_indices])).float()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (Hugging Face names) in, fusing q/k/v and the cross k/v as they arrive."""
        cfg = self.config
        copier = CheckpointCopier(self, cfg.architecture, {"qkv_proj": 3, "cross_kv_proj": 2})
        for hf_name, tensor in weights:
            ours = _our_name(hf_name, cfg)
            if ours is None:
                continue  # a copy of a tied table, or sinusoids we compute
            if ours[0] == "lm_head.bias":
                tensor = tensor.reshape(-1)  # final_logits_bias is stored [1, vocab]
            copier.copy(hf_name, *ours, tensor)
        copier.check_complete({"lm_head.weight"} if cfg.tie_word_embeddings else set())


# Hugging Face names (the "model." prefix removed) -> ours: (name, which third of a fused projection or None)
_FUSED_PARTS = {"self_attn.q_proj": ("qkv_proj", 0), "self_attn.k_proj": ("qkv_proj", 1),
                "self_attn.v_proj": ("qkv_proj", 2), "encoder_attn.k_proj": ("cross_kv_proj", 0),
                "encoder_attn.v_proj": ("cross_kv_proj", 1)}
_RENAMED = {"self_attn.out_proj": "out_proj", "encoder_attn.q_proj": "cross_q_proj",
            "encoder_attn.out_proj": "cross_out_proj"}
_LAYER = re.compile(r"^(encoder|decoder)\.layers\.(\d+)\.(\w+\.\w+)\.(weight|bias)$")


def _our_name(hf_name: str, cfg: Seq2SeqConfig) -> tuple[str, int | None] | None:
    """None for a tensor we do not keep: a tied table's copies, or fixed sinusoids (older Marian files hold them)."""
    name = hf_name.removeprefix("model.")
    if name == "final_logits_bias":
        return "lm_head.bias", None
    shared = cfg.encoder_vocab_size is None
    if name == "shared.weight":  # the one table of a tied checkpoint; untied ones use each stack's own
        return ("decoder.embed_tokens.weight", None) if shared else None
    if ((name == "encoder.embed_tokens.weight" and shared)
            or (name == "lm_head.weight" and cfg.tie_word_embeddings)
            or (name.endswith("embed_positions.weight") and cfg.model_type not in LEARNED_POSITIONS)):
        return None
    match = _LAYER.match(name)
    if match:
        side, index, module, kind = match.groups()
        if module in _FUSED_PARTS:
            fused, third = _FUSED_PARTS[module]
            return f"{side}.layers.{index}.{fused}.{kind}", third
        if module in _RENAMED:
            return f"{side}.layers.{index}.{_RENAMED[module]}.{kind}", None
    return name, None


def _sinusoids(cfg: Seq2SeqConfig) -> torch.Tensor:
    """The fixed position table, row p for position p: Marian's (sin of the even dims' angles, then cos of the odd
    ones'), or fairseq's as M2M100 uses it (tensor2tensor's frequencies, rows from pad + 1)."""
    dim, rows = cfg.hidden_size, cfg.max_position_embeddings
    if cfg.model_type == "marian":
        exponents = 2 * (torch.arange(dim, dtype=torch.float64) // 2) / dim
        angles = torch.arange(rows, dtype=torch.float64)[:, None] / torch.pow(10000.0, exponents)[None, :]
        return torch.cat([angles[:, 0::2].sin(), angles[:, 1::2].cos()], dim=1).float()
    half = dim // 2
    frequencies = torch.exp(torch.arange(half).float() * -(math.log(10000) / (half - 1)))
    first = cfg.pad_token_id + 1
    angles = torch.arange(first, first + rows).float()[:, None] * frequencies[None, :]
    table = torch.cat([angles.sin(), angles.cos()], dim=1)
    return F.pad(table, (0, dim % 2))
