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

from fasterllm.config import GATED_GELU_FORMS, KVCacheSpec, ModelConfig
from fasterllm.distributed.tensor_parallel import SINGLE_DEVICE, TensorParallel
from fasterllm.layers.activation import GeluAndMul, SiluAndMul
from fasterllm.layers.attention import AttentionMetadata
from fasterllm.layers.attention_layer import Attention, norm_heads
from fasterllm.layers.linear import pack_linears
from fasterllm.layers.moe import SparseMoE
from fasterllm.layers.norm import RMSNorm, norm_add_norm
from fasterllm.layers.rotary import rotary_embedding
from fasterllm.layers.vocab_parallel import VocabParallelEmbedding
from fasterllm.loader.weight_parts import WeightSource
from fasterllm.models.llama_checkpoint import load_llama_weights
from fasterllm.models.llama_cpu_decode import CPUDecodeStack


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel, index: int):
        """tp: this rank's heads and FFN rows only (attention heads and the intermediate size split over ranks).
        index: the layer's place in the stack (its sliding window, where layers differ)."""
        super().__init__()
        self.tp, self.intermediate_size = tp, tp.shard(cfg.intermediate_size, "intermediate_size")
        # checkpoint projection -> (the fused projection holding it, first row, rows), as the loader fills them
        self.fused_parts = {"gate_proj": ("gate_up_proj", 0, self.intermediate_size),
                            "up_proj": ("gate_up_proj", self.intermediate_size, self.intermediate_size)}
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self._init_attention(cfg, tp, index)
        # Llama: the norm before the FFN (Hugging Face's name for it). Gemma 2: the norm after attention, with one
        # before and one after the FFN besides
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        else:
            self.pre_feedforward_layernorm = self.post_feedforward_layernorm = None
        self.act = SiluAndMul() if cfg.hidden_act == "silu" else GeluAndMul(GATED_GELU_FORMS[cfg.hidden_act])
        if cfg.expert_layers is not None and cfg.expert_layers[index]:  # a mixture of experts instead of one FFN
            # each rank: every expert (and the shared one) on its share of the intermediate size, as the dense FFN
            self.moe = SparseMoE(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok,
                                 tp.shard(cfg.moe_intermediate_size, "moe_intermediate_size"), cfg.norm_topk_prob,
                                 self.act, tp.shard(cfg.shared_expert_intermediate_size,
                                                    "shared_expert_intermediate_size"),
                                 cfg.shared_expert_gated, cfg.routed_scaling_factor, cfg.expert_groups)
        else:
            self.moe = None
            self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * self.intermediate_size, bias=cfg.mlp_bias)
            self.down_proj = nn.Linear(self.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        # a dense FFN without sandwich norms leaves its down projection to whoever reads its output (the next
        # layer's norm or the final one: TensorParallel.row_parallel_add_norm), so that with tensor parallelism a
        # one-row product can hand its row to the all-reduce itself
        self.leaves_down_proj = self.moe is None and not cfg.sandwich_norms

    def _init_attention(self, cfg: ModelConfig, tp: TensorParallel, index: int) -> None:
        """The attention's projections and layer: fused q/k/v (this rank's heads, named in fused_parts), optional q/k
        norms, o_proj."""
        num_heads = tp.shard(cfg.num_attention_heads, "num_attention_heads")
        num_kv_heads = tp.kv_heads(cfg.num_key_value_heads)[1]
        q_size, kv_size = num_heads * cfg.head_dim, num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.attention_bias)
        self.fused_parts.update({"q_proj": ("qkv_proj", 0, q_size), "k_proj": ("qkv_proj", q_size, kv_size),
                                 "v_proj": ("qkv_proj", q_size + kv_size, kv_size)})
        self.qkv_shape = (num_heads + 2 * num_kv_heads, cfg.head_dim)
        self.num_q_heads, self.num_kv_heads = num_heads, num_kv_heads
        if cfg.qk_norm:  # Qwen3, Gemma 3: each head's query and key normalised before RoPE; OLMoE: all heads at once
            q_width, k_width = (q_size, kv_size) if cfg.qk_norm_over_heads else (cfg.head_dim, cfg.head_dim)
            self.q_norm, self.k_norm = RMSNorm(q_width, cfg.rms_norm_eps), RMSNorm(k_width, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.clip_qkv = cfg.clip_qkv
        scale = None if cfg.query_pre_attn_scalar is None else cfg.query_pre_attn_scalar ** -0.5
        self.attn = Attention(num_heads, num_kv_heads, cfg.head_dim, cfg.layer_window(index), scale,
                              cfg.attn_logit_softcap)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=cfg.o_proj_bias)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                rope: torch.Tensor | tuple[torch.Tensor, torch.Tensor], kv_cache: torch.Tensor | None,
                meta: AttentionMetadata, incoming_norm: nn.Module | None = None,
                incoming_projection: nn.Module | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: this rank's part of the embedding's rows (residual None: summed over the vocabulary's ranks here,
        in the norm's launch where the tensor-parallel group can), or the previous layer's output: with sandwich
        norms its FFN output, summed over the ranks, which goes through incoming_norm (that layer's post-FFN norm)
        before the residual add and this layer's norm (one launch); else its FFN's partial sums over the ranks, or,
        where that layer leaves its down projection (leaves_down_proj), the projection's input and
        incoming_projection the projection: projected, summed here with the residual add and norm (one fused launch
        where the tensor-parallel group can). Returns the same for the next layer."""
        if residual is None:
            hidden, residual = self.tp.all_reduce_add_norm(hidden, None, self.input_layernorm)  # W8A8: quantized
        elif self.pre_feedforward_layernorm is not None:
            hidden, residual = norm_add_norm(hidden, residual, incoming_norm, self.input_layernorm)
        else:
            hidden, residual = self.tp.row_parallel_add_norm(incoming_projection, hidden, residual,
                                                             self.input_layernorm)
        # row-parallel o_proj and down_proj: each rank's partial sum, summed over ranks before the residual add
        attended = self._attention(hidden, rope, kv_cache, meta)
        if self.pre_feedforward_layernorm is None:
            hidden, residual = self.tp.row_parallel_add_norm(self.o_proj, attended, residual,
                                                             self.post_attention_layernorm)
            return self._ffn(hidden), residual
        hidden, residual = norm_add_norm(self.tp.all_reduce(self.o_proj(attended)), residual,
                                         self.post_attention_layernorm, self.pre_feedforward_layernorm)
        return self.tp.all_reduce(self._ffn(hidden)), residual

    def _attention(self, hidden: torch.Tensor, rope: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
                   kv_cache: torch.Tensor | None, meta: AttentionMetadata) -> torch.Tensor:
        """The normed rows -> this rank's heads of the attention's output, o_proj's input."""
        qkv = self.qkv_proj(hidden).view(-1, *self.qkv_shape)
        head_norms = None if self.q_norm is None else (self.q_norm, self.k_norm)
        if head_norms is not None and (self.clip_qkv is not None or self.q_norm.weight.shape[0] != qkv.shape[2]):
            # norms a clip follows, or norms over all heads at once (OLMoE): here, not inside the attention
            qkv, head_norms = norm_heads(qkv, *head_norms, self.num_q_heads, self.num_kv_heads), None
        if self.clip_qkv is not None:
            qkv = qkv.clamp(-self.clip_qkv, self.clip_qkv)
        return self.attn(qkv, rope, kv_cache, meta, head_norms)

    def _ffn(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's partial sums of the FFN's output; where the layer leaves its down projection, that
        projection's input."""
        if self.moe is not None:
            return self.moe(hidden)
        activated = self.act(self.gate_up_proj(hidden))
        return activated if self.leaves_down_proj else self.down_proj(activated)


class LlamaForCausalLM(nn.Module):
    decoder_layer: type[DecoderLayer] = DecoderLayer  # a family with another attention gives its own layer
    # on the CPU: decode steps through all layers in one C++ call where it runs them (use_cpu_decode_stack)
    cpu_decode_stack: CPUDecodeStack | None = None

    def __init__(self, cfg: ModelConfig, max_positions: int, device: torch.device, dtype: torch.dtype,
                 tp: TensorParallel = SINGLE_DEVICE):
        """tp: build this rank's shard only (heads, FFN rows and vocabulary rows split over tp.size ranks)."""
        super().__init__()
        self.config, self.tp = cfg, tp
        vocab_rows = tp.vocab_rows(cfg.vocab_size)[1]
        with torch.device("meta"):  # allocate once, below, without a random init
            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
            self.layers = nn.ModuleList(self.decoder_layer(cfg, tp, index) for index in range(cfg.num_hidden_layers))
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, vocab_rows, bias=False)
        self.to(dtype).to_empty(device=device).requires_grad_(False)
        # one table per distinct (base, scaling) (Gemma 3: its local and global layers'), and each layer's
        ropes = [cfg.layer_rope_of(index) for index in range(cfg.num_hidden_layers)]
        distinct = [rope for index, rope in enumerate(ropes) if rope not in ropes[:index]]
        self.rope_of_layer = [distinct.index(rope) for rope in ropes]
        self.rotaries = [rotary_embedding(cfg.rotary_dim, max_positions, theta, scaling, cfg.rope_freq_factors, device,
                                          dtype) for theta, scaling in distinct]

    def head_as_linear(self) -> None:
        """Make the output head an nn.Linear module, so CPU packing, quantization and the GPU's matrix-vector
        layers replace it like the projections: a tied head gets one over the embedding table's weight (the
        table keeps its rows for lookups; the replacement makes the head's own copy or view)."""
        if self.lm_head is None:
            self.lm_head = nn.Linear(self.config.hidden_size, self.embed_tokens.num_rows, bias=False, device="meta")
            self.lm_head.weight = self.embed_tokens.weight

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        """What each layer caches, in layer order."""
        return [layer.attn.kv_spec for layer in self.layers]

    def set_kv_cache_scales(self, scales: list[tuple[float, float]]) -> None:
        """Each layer's (k_scale, v_scale) of an fp8 KV cache, in layer order (every rank: a scale covers all of a
        layer's KV heads)."""
        if len(scales) != len(self.layers):
            raise ValueError(f"{len(scales)} layers' KV-cache scales for a model of {len(self.layers)} layers; the "
                             "checkpoint and its config disagree")
        for layer, layer_scales in zip(self.layers, scales):
            layer.attn.kv_scales = layer_scales

    def use_cpu_decode_stack(self) -> None:
        """Run CPU decode steps through models/llama_cpu_decode.py where every layer is one it runs."""
        self.cpu_decode_stack = CPUDecodeStack.of(self)

    def pack_for_cpu(self) -> None:
        """Reorder every projection's weight (and the head's, once head_as_linear made it a Linear) for oneDNN."""
        pack_linears(self)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: torch.Tensor,
                meta: AttentionMetadata, logits_indices: torch.Tensor) -> torch.Tensor:
        """Flat batch of new tokens -> fp32 logits of the rows in logits_indices only."""
        return self.compute_logits(self.hidden_states(input_ids, positions, kv_caches, meta, logits_indices))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final norm's output rows -> their fp32 logits."""
        logits = F.linear(hidden, self.embed_tokens.weight) if self.lm_head is None else self.lm_head(hidden)
        if self.tp.size > 1:  # each rank's vocabulary rows, gathered (the last rank's padding dropped)
            logits = self.tp.gather_last_dim(logits)[:, :self.config.vocab_size]
        cap = self.config.final_logit_softcap
        return logits.float() if cap is None else logits.float().div_(cap).tanh_().mul_(cap)

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: torch.Tensor | None,
                      meta: AttentionMetadata, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Flat batch of new tokens -> the final norm's output (what the output head reads) at `rows`, or at
        every row when None. kv_caches=None: no cache (torch path only, every sequence a whole prompt)."""
        hidden = self.embed_tokens.partial_rows(input_ids)  # summed over the ranks by the first layer's norm
        if self.config.embedding_multiplier is not None:  # Gemma: by sqrt(hidden), rounded to the dtype first
            hidden = hidden * torch.tensor(self.config.embedding_multiplier, dtype=hidden.dtype)
        ropes = [rotary.cos_sin if meta.kernel is not None else rotary.cos_sin_for(positions)
                 for rotary in self.rotaries]
        incoming_norm = None  # sandwich norms: the previous layer's post-FFN norm, applied by the next norm's launch
        if self.cpu_decode_stack is not None and self.cpu_decode_stack.takes(hidden, kv_caches, meta):
            # a decode step on the CPU: every layer in one C++ call, which leaves the last down projection
            hidden, residual = self.cpu_decode_stack(hidden, ropes[0], kv_caches, meta)
            incoming_projection = self.layers[-1].down_proj
        else:
            residual = None
            caches = kv_caches if kv_caches is not None else [None] * len(self.layers)
            incoming_projection = None  # the down projection the previous layer left to this one
            for layer, kv_cache, rope in zip(self.layers, caches, self.rope_of_layer):
                hidden, residual = layer(hidden, residual, ropes[rope], kv_cache, meta, incoming_norm,
                                         incoming_projection)
                incoming_norm = layer.post_feedforward_layernorm
                incoming_projection = layer.down_proj if layer.leaves_down_proj else None
        if rows is not None:
            if incoming_projection is not None:  # project every row, as the layer would have, then take rows
                hidden, incoming_projection = incoming_projection(hidden), None
            hidden, residual = hidden[rows], residual[rows]
        if self.config.sandwich_norms:  # the last layer's output is summed over the ranks already
            return norm_add_norm(hidden, residual, incoming_norm, self.norm)[0]
        return self.tp.row_parallel_add_norm(incoming_projection, hidden, residual, self.norm)[0]

    def load_weights(self, weights: Iterable[tuple[str, WeightSource]]) -> None:
        """Copy checkpoint tensors (Hugging Face names) in: models/llama_checkpoint.py."""
        load_llama_weights(self, weights)
