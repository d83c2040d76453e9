"""What llama.cpp's converter (convert_hf_to_gguf.py) writes for each architecture we load from GGUF, and how to
read it back: one GGUFFamily a GGUF architecture name, holding its tensor names where they differ from Llama's, what
the converter changed in the weights (Q/K rows permuted, Gemma's norms stored as 1 + weight) and the config fields
that only its metadata carries. loader/gguf_checkpoint.py reads the common part.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fasterllm.loader.gguf_checkpoint import GGUFFile


@dataclass(frozen=True)
class GGUFFamily:
    architecture: str  # our (Hugging Face) architecture name
    permuted_qk: bool = False  # the converter reordered Q/K rows for llama.cpp's interleaved RoPE
    layer_names: dict[str, str] = field(default_factory=dict)  # GGUF layer tensor -> HF module, over the common ones
    projections: dict[str, tuple[str, ...]] = field(default_factory=dict)  # our fused projection -> GGUF tensors
    norm_shift: float = 0.0  # the converter added this to every norm weight (Gemma: (1 + weight) stored)
    experts_normalized: bool = False  # top-k weights renormalized, when the file has no expert_weights_norm key
    fields: Callable[[GGUFFile], dict[str, Any]] | None = None  # ModelConfig fields from family-specific metadata


def _gemma_fields(gguf: GGUFFile) -> dict[str, Any]:
    """Gemma 2 / 3: what the file holds (soft-caps, window, RoPE bases) and what llama.cpp fixes by architecture:
    GELU (tanh) gates, embeddings times sqrt(hidden), queries scaled by 1 / sqrt(head_dim) except the 27B shapes
    (46 layers for Gemma 2, 62 for Gemma 3), which use 1 / sqrt(hidden / heads); Gemma 2 slides on even layers,
    Gemma 3 on five layers of six unless the file's sliding_window_pattern says otherwise."""
    meta, arch = gguf.metadata, gguf.arch
    hidden, heads = gguf.required(f"{arch}.embedding_length"), gguf.required(f"{arch}.attention.head_count")
    layers = gguf.required(f"{arch}.block_count")
    head_dim = meta.get(f"{arch}.attention.key_length", hidden // heads)
    gemma2 = arch == "gemma2"
    scalar = hidden // heads if layers == (46 if gemma2 else 62) else head_dim
    window = meta.get(f"{arch}.attention.sliding_window")
    sliding = [i % 2 == 0 for i in range(layers)] if gemma2 else _gemma3_sliding_layers(gguf, layers)
    fields = dict(hidden_act="gelu_pytorch_tanh", norm_plus_one=True, embedding_multiplier=hidden ** 0.5,
                  sandwich_norms=True, query_pre_attn_scalar=scalar,
                  attn_logit_softcap=meta.get(f"{arch}.attn_logit_softcapping", 50.0 if gemma2 else None),
                  final_logit_softcap=meta.get(f"{arch}.final_logit_softcapping", 30.0 if gemma2 else None),
                  sliding_window=None,
                  layer_sliding_windows=[window if slides and window else None for slides in sliding])
    if not gemma2:  # global layers: the file's base and scaling; sliding ones: their own base, unscaled
        local = (float(meta.get(f"{arch}.rope.freq_base_swa", 10_000.0)), None)
        fields["layer_rope"] = [local if slides else (gguf.rope_theta(1_000_000.0), gguf.rope_scaling())
                                for slides in sliding]
    return fields


def _gemma3_sliding_layers(gguf: GGUFFile, layers: int) -> list[bool]:
    key = f"{gguf.arch}.attention.sliding_window_pattern"
    pattern = gguf.metadata.get(key, 6)
    if isinstance(pattern, list):  # one flag a layer
        if len(pattern) != layers:
            raise ValueError(f"{key} in {gguf.path.name} lists {len(pattern)} layers but the file has {layers}; "
                             "the file is inconsistent: convert it again")
        return [bool(p) for p in pattern]
    return [pattern == 0 or i % pattern < pattern - 1 for i in range(layers)]  # llama.cpp's period form


def _phi3_fields(gguf: GGUFFile) -> dict[str, Any]:
    """Phi-3: a sliding window of 0 means none (Phi-4); the 128k models' LongRoPE factors are two tensors."""
    meta, arch = gguf.metadata, gguf.arch
    fields: dict[str, Any] = {"sliding_window": meta.get(f"{arch}.attention.sliding_window") or None}
    if gguf.has_tensor("rope_factors_long.weight"):
        original = gguf.required(f"{arch}.rope.scaling.original_context_length")
        factor = gguf.required(f"{arch}.context_length") / original
        fields["rope_scaling"] = {
            "rope_type": "longrope", "original_max_position_embeddings": original, "factor": factor,
            "short_factor": gguf.float_tensor("rope_factors_short.weight").tolist(),
            "long_factor": gguf.float_tensor("rope_factors_long.weight").tolist(),
            "attention_factor": meta.get(f"{arch}.rope.scaling.attn_factor")
            or (math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0)}
    return fields


def _olmoe_fields(gguf: GGUFFile) -> dict[str, Any]:
    return {"clip_qkv": gguf.metadata.get(f"{gguf.arch}.attention.clamp_kqv")}


_GEMMA_NAMES = {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}

# GGUF architecture -> its family. "llama" with expert tensors is Mixtral (the converter writes it so).
GGUF_FAMILIES = {
    "llama": GGUFFamily("LlamaForCausalLM", permuted_qk=True, experts_normalized=True),
    "mistral": GGUFFamily("MistralForCausalLM", permuted_qk=True),
    "qwen2": GGUFFamily("Qwen2ForCausalLM"),
    "qwen3": GGUFFamily("Qwen3ForCausalLM"),
    "gemma2": GGUFFamily("Gemma2ForCausalLM", layer_names=_GEMMA_NAMES, norm_shift=1.0, fields=_gemma_fields),
    "gemma3": GGUFFamily("Gemma3ForCausalLM", layer_names=_GEMMA_NAMES, norm_shift=1.0, fields=_gemma_fields),
    # q/k/v stored fused as attn_qkv; gate and up fused as ffn_up (gate rows first), the names our fused
    # projections take apart again
    "phi3": GGUFFamily("Phi3ForCausalLM", layer_names={"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
                       projections={"qkv_proj": ("attn_qkv",), "gate_up_proj": ("ffn_up",)}, fields=_phi3_fields),
    "qwen2moe": GGUFFamily("Qwen2MoeForCausalLM"),
    "qwen3moe": GGUFFamily("Qwen3MoeForCausalLM", experts_normalized=True),
    "olmoe": GGUFFamily("OlmoeForCausalLM", fields=_olmoe_fields),
}
MIXTRAL = "MixtralForCausalLM"
# the Hugging Face architectures a GGUF file can hold (`fasterllm models`)
GGUF_HF_ARCHITECTURES = frozenset({family.architecture for family in GGUF_FAMILIES.values()} | {MIXTRAL})

# mixture-of-experts tensors: GGUF layer tensor -> HF module (the merged [experts, rows, cols] ones are split into
# each expert's mlp.experts.<e>.<module>)
EXPERT_NAMES = {"ffn_gate_inp": "mlp.gate", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
                "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj",
                "ffn_gate_inp_shexp": "mlp.shared_expert_gate"}
MERGED_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
