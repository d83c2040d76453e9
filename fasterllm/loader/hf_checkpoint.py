"""Hugging Face model directories: config.json and safetensors (one file or sharded with an index)."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import safe_open

from fasterllm.config import (
    ENCODER_DECODER_ARCHITECTURES,
    GATED_GELU_FORMS,
    GEMMA_ARCHITECTURES,
    LATENT_ATTENTION_ARCHITECTURES,
    MOE_ARCHITECTURES,
    QK_NORM_OVER_HEADS_ARCHITECTURES,
    LatentAttentionShape,
    ModelConfig,
    check_architecture,
)
from fasterllm.seq2seq_config import Seq2SeqConfig, T5Config


def read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON ({exc}); the model directory is corrupt") from exc


def load_hf_config(model_dir: Path) -> ModelConfig | Seq2SeqConfig | T5Config:
    """The model's config; an architecture we do not run is refused before any of its fields is read."""
    raw = read_json(model_dir / "config.json")
    architectures = raw.get("architectures") or []
    if not architectures:
        raise ValueError(f"{model_dir / 'config.json'} names no 'architectures'; cannot tell which model to build")
    check_architecture(architectures[0])
    generation = read_json(model_dir / "generation_config.json") if (model_dir / "generation_config.json").is_file() \
        else {}
    # chat models often list extra stop ids in generation_config.json
    eos = generation.get("eos_token_id", raw.get("eos_token_id"))
    if architectures[0] in ENCODER_DECODER_ARCHITECTURES:
        # what generate() starts the decoder with and forces first: generation_config.json's, else config.json's
        start, forced_bos = (generation[key] if generation.get(key) is not None else raw.get(key)
                             for key in ("decoder_start_token_id", "forced_bos_token_id"))
        config_class = T5Config if architectures[0] == "T5ForConditionalGeneration" else Seq2SeqConfig
        return config_class.from_hf({**raw, "decoder_start_token_id": start}, eos, forced_bos)
    # transformers 5 keeps rope settings in rope_parameters; older configs use rope_theta + rope_scaling
    rope = dict(raw.get("rope_parameters") or {})
    rope_theta = rope.pop("rope_theta", raw.get("rope_theta", 10000.0))
    scaling = raw.get("rope_scaling") or rope or None
    if scaling is not None and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) in ("longrope", "su"):  # Phi-3 128k
        original = scaling.get("original_max_position_embeddings") or raw["original_max_position_embeddings"]
        scaling = {**scaling, "original_max_position_embeddings": original,
                   "factor": scaling.get("factor") or raw["max_position_embeddings"] / original}
    num_heads = raw["num_attention_heads"]
    qwen2 = architectures[0].startswith("Qwen2")
    gemma = architectures[0] in GEMMA_ARCHITECTURES
    if architectures[0] == "Gemma3ForCausalLM":  # a RoPE per layer kind in rope_parameters: _gemma_fields reads it
        rope_theta, scaling = 10000.0, None
    fields = dict(
        architecture=architectures[0],
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_hidden_layers=raw["num_hidden_layers"],
        num_attention_heads=num_heads,
        num_key_value_heads=raw.get("num_key_value_heads") or num_heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope_theta),
        rope_scaling=scaling,
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        tie_word_embeddings=raw.get("tie_word_embeddings", gemma),  # Gemma's default: tied
        # Qwen2 always has q/k/v biases (and no o_proj bias); LLaMA-style configs say so with attention_bias
        attention_bias=raw.get("attention_bias", qwen2),
        o_proj_bias=raw.get("attention_bias", False) and not qwen2,
        sliding_window=None if gemma else raw.get("sliding_window") if raw.get("use_sliding_window", not qwen2)
        else None,
        mlp_bias=raw.get("mlp_bias", False),
        qk_norm=architectures[0] in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM", "OlmoeForCausalLM"),
        qk_norm_over_heads=architectures[0] in QK_NORM_OVER_HEADS_ARCHITECTURES,
        clip_qkv=raw.get("clip_qkv"),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
        **(_gemma_fields(raw, architectures[0]) if gemma else {}),
        **(_expert_fields(raw, architectures[0]) if architectures[0] in MOE_ARCHITECTURES else {}),
    )
    if architectures[0] in LATENT_ATTENTION_ARCHITECTURES:  # its own head shape, in place of the Llama fields'
        fields.update(_latent_attention_fields(raw))
    return ModelConfig(**fields)


def _latent_attention_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek-V2's attention shape: every head its own keys and values (expanded from the latent), each query and
    key qk_nope_head_dim + qk_rope_head_dim wide (transformers' head_dim says the rotated width alone)."""
    shape = LatentAttentionShape(raw.get("q_lora_rank"), raw["kv_lora_rank"], raw["qk_nope_head_dim"],
                                 raw["qk_rope_head_dim"], raw["v_head_dim"])
    return dict(latent_attention=shape, num_key_value_heads=raw["num_attention_heads"],
                head_dim=shape.qk_nope_head_dim + shape.qk_rope_head_dim)


def _deepseek_expert_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek-V2: softmax scores, the top num_experts_per_tok (within the topk_group best of n_group groups under
    group_limited_greedy) times routed_scaling_factor, n_shared_experts ungated shared experts as one FFN, dense
    layers before first_k_dense_replace and off every moe_layer_freq-th layer. norm_topk_prob (false in the released
    V2 configs; transformers ignores it) renormalizes the top weights before the scale, as DeepSeek-V3 does."""
    method, scoring = raw.get("topk_method") or "greedy", raw.get("scoring_func") or "softmax"
    if method not in ("greedy", "group_limited_greedy") or scoring != "softmax":
        raise ValueError(f"topk_method={method!r} with scoring_func={scoring!r} is not supported for "
                         "DeepseekV2ForCausalLM; supported: 'greedy' or 'group_limited_greedy' over 'softmax' scores")
    groups = (raw["n_group"], raw["topk_group"]) if method == "group_limited_greedy" else None
    if groups is not None and raw["n_routed_experts"] % groups[0]:
        raise ValueError(f"n_routed_experts={raw['n_routed_experts']} does not split into n_group={groups[0]} equal "
                         "groups; the checkpoint's config is inconsistent")
    first_moe, every = raw.get("first_k_dense_replace") or 0, raw.get("moe_layer_freq") or 1
    return dict(num_experts=raw["n_routed_experts"], num_experts_per_tok=raw["num_experts_per_tok"],
                moe_intermediate_size=raw["moe_intermediate_size"], norm_topk_prob=bool(raw.get("norm_topk_prob")),
                shared_expert_intermediate_size=(raw.get("n_shared_experts") or 0) * raw["moe_intermediate_size"],
                shared_expert_gated=False, routed_scaling_factor=float(raw.get("routed_scaling_factor") or 1.0),
                expert_groups=groups,
                expert_layers=[i >= first_moe and i % every == 0 for i in range(raw["num_hidden_layers"])])


def _expert_fields(raw: dict[str, Any], architecture: str) -> dict[str, Any]:
    """A mixture of experts' shape (ModelConfig says what each field is). Mixtral: every layer, experts of
    intermediate_size, weights always renormalized; Qwen: experts on every decoder_sparse_step-th layer not in
    mlp_only_layers, of moe_intermediate_size, renormalized when norm_topk_prob, a shared expert (Qwen2-MoE)."""
    layers = raw["num_hidden_layers"]
    if architecture == "DeepseekV2ForCausalLM":
        return _deepseek_expert_fields(raw)
    if architecture == "MixtralForCausalLM":
        return dict(num_experts=raw["num_local_experts"], num_experts_per_tok=raw["num_experts_per_tok"],
                    moe_intermediate_size=raw["intermediate_size"], norm_topk_prob=True, expert_layers=[True] * layers)
    if architecture == "OlmoeForCausalLM":  # every layer, experts of intermediate_size
        return dict(num_experts=raw["num_experts"], num_experts_per_tok=raw["num_experts_per_tok"],
                    moe_intermediate_size=raw["intermediate_size"], norm_topk_prob=bool(raw.get("norm_topk_prob")),
                    expert_layers=[True] * layers)
    step, dense = raw.get("decoder_sparse_step", 1) or 1, set(raw.get("mlp_only_layers") or [])
    # Qwen3-MoE configs written by transformers 5 say num_local_experts
    return dict(num_experts=raw.get("num_experts") or raw["num_local_experts"],
                num_experts_per_tok=raw["num_experts_per_tok"],
                moe_intermediate_size=raw["moe_intermediate_size"], norm_topk_prob=bool(raw.get("norm_topk_prob")),
                shared_expert_intermediate_size=raw.get("shared_expert_intermediate_size") or 0,
                expert_layers=[i not in dense and (i + 1) % step == 0 for i in range(layers)])


def _gemma_fields(raw: dict[str, Any], architecture: str) -> dict[str, Any]:
    """Gemma 2's and Gemma 3's departures from the Llama layer (ModelConfig says what each is), with transformers'
    defaults where the config leaves a field out."""
    hidden_act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    if hidden_act not in GATED_GELU_FORMS:
        raise ValueError(f"hidden_activation={hidden_act!r} is not supported for {architecture}; supported: "
                         f"{', '.join(GATED_GELU_FORMS)}")
    layers = raw["num_hidden_layers"]
    gemma3 = architecture == "Gemma3ForCausalLM"
    # Gemma 2 slides on even layers; Gemma 3 on five of every six (sliding_window_pattern)
    pattern = raw.get("sliding_window_pattern", 6) if gemma3 else 2
    types = raw.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                       for i in range(layers)]
    window = raw.get("sliding_window", 4096)
    fields = dict(hidden_act=hidden_act, norm_plus_one=True, embedding_multiplier=raw["hidden_size"] ** 0.5,
                  sandwich_norms=True, query_pre_attn_scalar=raw.get("query_pre_attn_scalar", 256),
                  attn_logit_softcap=raw.get("attn_logit_softcapping", None if gemma3 else 50.0),
                  final_logit_softcap=raw.get("final_logit_softcapping", None if gemma3 else 30.0),
                  layer_sliding_windows=[window if kind == "sliding_attention" else None for kind in types])
    if gemma3:
        fields["layer_rope"] = [_gemma3_rope(raw, kind) for kind in types]
    return fields


def _gemma3_rope(raw: dict[str, Any], kind: str) -> tuple[float, dict[str, Any] | None]:
    """(base, scaling) of a Gemma 3 layer kind: rope_parameters[kind] (transformers 5), else the older rope_theta
    (global layers, with rope_scaling) and rope_local_base_freq (sliding ones)."""
    params = dict((raw.get("rope_parameters") or {}).get(kind) or {})
    if kind == "full_attention":
        theta = params.pop("rope_theta", raw.get("rope_theta", 1_000_000.0))
        params = params or dict(raw.get("rope_scaling") or {})
    else:
        theta = params.pop("rope_theta", raw.get("rope_local_base_freq", 10_000.0))
    scaling = params if params.get("rope_type", params.get("type", "default")) != "default" else None
    return float(theta), scaling


def iter_safetensors(model_dir: Path, lazy: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of the checkpoint, shard by shard. lazy: safetensors slices instead, read
    when indexed (loader/weight_parts.py), each only until the next is yielded."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(read_json(index)["weight_map"].values()))
    else:
        files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} has no *.safetensors weights (only safetensors checkpoints are loaded)")
    for name in files:
        path = model_dir / name
        if not path.is_file():
            raise FileNotFoundError(f"{index} lists shard {name!r} but {path} does not exist")
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    yield key, f.get_slice(key) if lazy else f.get_tensor(key)
        except SafetensorError as exc:
            raise ValueError(f"{path} is not a readable safetensors file ({exc}); the checkpoint is corrupt") from exc
