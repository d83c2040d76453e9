"""Gemma 2 / 3, Phi-3 and the mixtures of experts load from GGUF files laid out as llama.cpp's convert_hf_to_gguf.py
lays them out: its tensor names, experts merged into one [experts, rows, cols] tensor a projection (the router kept
F32, as llama-quantize keeps it), Gemma's norms stored as 1 + weight, Mixtral's Q/K rows permuted (it converts as
"llama"), Phi-3's fused attn_qkv and gate+up ffn_up, its LongRoPE factors as tensors, and only the metadata the
converter writes (what it leaves out, llama.cpp fixes by architecture: Gemma's query scale, Gemma 3's window
pattern). The engine's tokens and logprobs equal transformers' on the weights the file dequantizes to."""
from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter, RopeScalingType, quants
from transformers import AutoModelForCausalLM
from transformers.convert_slow_tokenizer import bytes_to_unicode

sys.path.insert(0, str(Path(__file__).parents[1] / "parity"))
from parity_utils import TINY_SPECS, random_prompt, randomize_, tiny_config  # noqa: E402

from fasterllm import LLM, SamplingParams  # noqa: E402
from fasterllm.loader import gguf_checkpoint, gguf_families  # noqa: E402
from fasterllm.loader.gguf_checkpoint import GGUFFile  # noqa: E402

SPECS = {spec.name: spec for spec in TINY_SPECS}
# GGUF architecture, the tiny spec, and what differs from it: Q4 blocks need rows a multiple of 32 long, and the
# converter writes no query_pre_attn_scalar (llama.cpp uses head_dim) nor a dense layer among Qwen3-MoE experts
CASES = {
    "gemma2": ("gemma2", "gemma2_softcap_window", dict(query_pre_attn_scalar=16)),
    # six layers: llama.cpp's Gemma 3 window pattern (five sliding, one global); its own RoPE base per layer kind
    "gemma3": ("gemma3", "gemma3_local_global", dict(
        query_pre_attn_scalar=16, num_hidden_layers=6, layer_types=["sliding_attention"] * 5 + ["full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 20_000.0},
                         "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0}})),
    "phi3": ("phi3", "phi3_fused", {}),
    "phi3_longrope": ("phi3", "phi3_longrope", {}),
    "mixtral": ("llama", "mixtral_moe", dict(intermediate_size=64)),
    "qwen2moe": ("qwen2moe", "qwen2_moe_shared", dict(shared_expert_intermediate_size=64)),
    "qwen3moe": ("qwen3moe", "qwen3_moe_dense_layer", dict(moe_intermediate_size=32, mlp_only_layers=[])),
    "olmoe": ("olmoe", "olmoe_clip", dict(intermediate_size=32)),
}
NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
         "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
         "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
         "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
         "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
         "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
         "mlp.experts.down_proj": "ffn_down_exps"}
GEMMA_NAMES = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
               "post_feedforward_layernorm": "post_ffw_norm"}
PHI3_NAMES = {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}
EOS = 2  # the tiny specs' eos


def tiny_model(case: str):
    arch, spec_name, overrides = CASES[case]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(SPECS[spec_name], **overrides), dtype=torch.float32)
    randomize_(model, 0)
    return arch, model.eval()


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    rows = weight.shape[0]
    return weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def converted_tensors(arch: str, model) -> list[tuple[str, np.ndarray]]:
    """(GGUF name, float32 data) as convert_hf_to_gguf.py writes the model's tensors."""
    cfg, out = model.config, []
    names = {**NAMES, **(GEMMA_NAMES if arch.startswith("gemma") else {}), **(PHI3_NAMES if arch == "phi3" else {})}
    for name, tensor in model.state_dict().items():
        data = tensor.numpy().astype(np.float32)
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
               "lm_head.weight": "output.weight"}
        if name in top:
            gguf_name = top[name]
        else:
            parts = name.split(".")  # model.layers.N.<module...>[.weight]
            module, leaf = (".".join(parts[3:]), "weight") if parts[-1].endswith("_proj") else \
                (".".join(parts[3:-1]), parts[-1])
            if module == "mlp.experts.gate_up_proj":  # transformers' fused experts: gate rows, then up rows
                half = data.shape[1] // 2
                out += [(f"blk.{parts[2]}.ffn_gate_exps.weight", data[:, :half]),
                        (f"blk.{parts[2]}.ffn_up_exps.weight", data[:, half:])]
                continue
            gguf_name = f"blk.{parts[2]}.{names[module]}.{leaf}"
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            data = data + 1  # Gemma's (1 + weight) norms, stored so
        if arch == "llama" and gguf_name.split(".")[2:3] in (["attn_q"], ["attn_k"]):
            heads = cfg.num_attention_heads if ".attn_q." in gguf_name else cfg.num_key_value_heads
            data = llama_cpp_permute(data, heads)
        out.append((gguf_name, data))
    return out


def write_gguf(path: Path, arch: str, model, qtype: GGMLQuantizationType, eot: int | None = None) -> None:
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = cfg.rope_parameters
    writer.add_rope_freq_base(rope.get("full_attention", rope)["rope_theta"])
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
        writer.add_sliding_window(cfg.sliding_window)
    if arch == "gemma3":
        writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["full_attention"]["factor"])
        writer.add_sliding_window(cfg.sliding_window)
    tensors = converted_tensors(arch, model)
    if arch == "phi3":
        writer.add_rope_dimension_count(head_dim)
        writer.add_sliding_window(cfg.sliding_window or 0)
        original = cfg.rope_parameters.get("original_max_position_embeddings") or \
            getattr(cfg, "original_max_position_embeddings", None) or cfg.max_position_embeddings
        writer.add_rope_scaling_orig_ctx_len(original)
        if rope.get("long_factor"):
            scale = cfg.max_position_embeddings / original
            writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
            tensors += [("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32)),
                        ("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))]
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        if getattr(cfg, "moe_intermediate_size", None):
            writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        if getattr(cfg, "shared_expert_intermediate_size", None):
            writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if arch == "olmoe":
        writer.add_clamp_kqv(cfg.clip_qkv)
    byte_chars = list(bytes_to_unicode().values())
    tokens = (byte_chars + [f"<t{i}>" for i in range(256, cfg.vocab_size)])[:cfg.vocab_size]
    tokens[EOS] = "<|endoftext|>"
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i == EOS else 1 for i in range(cfg.vocab_size)])
    writer.add_token_merges([])
    writer.add_eos_token_id(EOS)
    if eot is not None:
        writer.add_eot_token_id(eot)
    for name, data in tensors:
        kind = qtype if data.ndim >= 2 and ".ffn_gate_inp." not in name else GGMLQuantizationType.F32
        writer.add_tensor(name, quants.quantize(np.ascontiguousarray(data), kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def dequantized_reference(model, qtype: GGMLQuantizationType):
    """The model with every tensor the file quantizes replaced by what its blocks dequantize to (in Hugging Face's
    layout: the converter's row reorderings and splits move whole rows, which blocks never cross)."""
    reference = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32).eval()
    state = {}
    for name, tensor in model.state_dict().items():
        data = tensor.numpy().astype(np.float32)
        if data.ndim >= 2 and not name.endswith("mlp.gate.weight"):
            data = quants.dequantize(quants.quantize(np.ascontiguousarray(data), qtype), qtype).reshape(data.shape)
        state[name] = torch.from_numpy(np.ascontiguousarray(data))
    reference.load_state_dict(state)
    return reference


def logprob_gap(llm, reference, prompts) -> float:
    """The largest difference between the engine's prompt logprobs and transformers'."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    gap = 0.0
    for prompt, output in zip(prompts, llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                    use_tqdm=False)):
        with torch.no_grad():
            expected = reference(torch.tensor([prompt])).logits[0].log_softmax(-1)
        expected = expected[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
        ours = torch.tensor([next(iter(entry.values())).logprob for entry in output.prompt_logprobs[1:]])
        gap = max(gap, (ours - expected).abs().max().item())
    return gap


@pytest.mark.parametrize("qtype", ["F16", "Q4_0"])
@pytest.mark.parametrize("case", list(CASES))
def test_llama_cpp_layout_gives_the_reference_tokens_and_logprobs(tmp_path, case, qtype):
    arch, model = tiny_model(case)
    qtype = GGMLQuantizationType[qtype]
    path = tmp_path / f"{case}.gguf"
    write_gguf(path, arch, model, qtype)
    reference = dequantized_reference(model, qtype)
    prompts = [random_prompt(40, model.config.vocab_size, seed) for seed in (1, 2)]
    llm = LLM(str(path), dtype="float32", cpu_kv_cache_gib=0.01)
    assert logprob_gap(llm, reference, prompts) < 1e-3
    ours = llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0]
    with torch.no_grad():
        expected = reference.generate(torch.tensor([prompts[0]]), max_new_tokens=12, do_sample=False,
                                      eos_token_id=EOS, pad_token_id=EOS)[0, 40:].tolist()
    assert ours.token_ids == expected[:len(ours.token_ids)] and len(ours.token_ids) > 0


def test_config_read_from_the_metadata(tmp_path):
    """What each family's file says lands in the config: Gemma 3's window pattern and RoPE per layer kind, Phi-3's
    LongRoPE, the experts' sizes, routing and layers."""
    configs = {}
    for case in ("gemma3", "phi3_longrope", "qwen2moe", "olmoe", "mixtral"):
        arch, model = tiny_model(case)
        eot = 5 if case == "gemma3" else None
        write_gguf(tmp_path / f"{case}.gguf", arch, model, GGMLQuantizationType.F32, eot=eot)
        configs[case] = GGUFFile(tmp_path / f"{case}.gguf").model_config()
    gemma3 = configs["gemma3"]
    assert gemma3.layer_sliding_windows == [8] * 5 + [None]
    assert gemma3.layer_rope == [(20_000.0, None)] * 5 + [(1_000_000.0, {"rope_type": "linear", "factor": 4.0})]
    assert gemma3.query_pre_attn_scalar == 16 and gemma3.attn_logit_softcap is None
    assert gemma3.eos_token_ids == [EOS, 5]  # <end_of_turn> stops a chat turn as the eos does
    scaling = configs["phi3_longrope"].rope_scaling
    assert scaling["original_max_position_embeddings"] == 160 and scaling["factor"] == 256 / 160
    assert scaling["short_factor"] == pytest.approx([1.0 + 0.3 * i for i in range(8)])
    qwen2moe = configs["qwen2moe"]
    assert (qwen2moe.architecture, qwen2moe.num_experts, qwen2moe.num_experts_per_tok, qwen2moe.moe_intermediate_size,
            qwen2moe.shared_expert_intermediate_size, qwen2moe.norm_topk_prob) == ("Qwen2MoeForCausalLM", 8, 4, 32,
                                                                                 64, False)
    assert configs["olmoe"].qk_norm_over_heads and configs["olmoe"].clip_qkv == 3.0
    assert configs["mixtral"].architecture == "MixtralForCausalLM" and configs["mixtral"].norm_topk_prob


@pytest.mark.parametrize("case, mutation", [
    ("gemma2", "norm_shift"), ("gemma3", "norm_shift"), ("mixtral", "permutation"), ("qwen3moe", "expert_split")])
def test_each_undone_conversion_step_matters(tmp_path, monkeypatch, case, mutation):
    """Leaving one of the converter's changes in place moves the logprobs far past the 1e-3 the tests allow."""
    arch, model = tiny_model(case)
    path = tmp_path / f"{case}.gguf"
    write_gguf(path, arch, model, GGMLQuantizationType.F32)
    family = gguf_families.GGUF_FAMILIES[arch]
    if mutation == "norm_shift":  # Gemma's stored (1 + weight) norms read as they are
        monkeypatch.setitem(gguf_families.GGUF_FAMILIES, arch, dataclasses.replace(family, norm_shift=0.0))
    elif mutation == "permutation":  # Mixtral's Q/K rows left in llama.cpp's order
        monkeypatch.setitem(gguf_families.GGUF_FAMILIES, arch, dataclasses.replace(family, permuted_qk=False))
    else:  # the merged gate and up experts read as each other
        monkeypatch.setattr(gguf_checkpoint, "MERGED_EXPERTS", {**gguf_families.MERGED_EXPERTS,
                                                                "ffn_gate_exps": "up_proj", "ffn_up_exps": "gate_proj"})
    llm = LLM(str(path), dtype="float32", cpu_kv_cache_gib=0.01)
    prompts = [random_prompt(40, model.config.vocab_size, 1)]
    assert logprob_gap(llm, dequantized_reference(model, GGMLQuantizationType.F32), prompts) > 0.1


def test_unsupported_variants_are_named(tmp_path):
    arch, model = tiny_model("qwen2moe")
    path = tmp_path / "sigmoid.gguf"
    writer_tensors = converted_tensors(arch, model)
    writer = GGUFWriter(str(path), arch)
    cfg = model.config
    for add, value in ((writer.add_block_count, cfg.num_hidden_layers), (writer.add_embedding_length, 64),
                       (writer.add_feed_forward_length, cfg.intermediate_size), (writer.add_head_count, 4),
                       (writer.add_expert_count, 8), (writer.add_expert_used_count, 4)):
        add(value)
    writer.add_uint32("qwen2moe.expert_gating_func", 2)  # sigmoid
    for name, data in writer_tensors:
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="gating function 2; only softmax"):
        GGUFFile(path).model_config()
    path = tmp_path / "yarn.gguf"
    writer = GGUFWriter(str(path), "qwen3moe")
    writer.add_rope_scaling_type(RopeScalingType.YARN)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(ValueError, match="RoPE scaling 'yarn', which is not supported from GGUF; supported: linear"):
        GGUFFile(path).rope_scaling()


@pytest.mark.parametrize("case", ["phi3", "qwen2moe"])
def test_quantization_gguf_keeps_fused_and_attention_blocks_and_dequantizes_experts(tmp_path, case):
    """quantization='gguf': Phi-3's stored-fused attn_qkv and ffn_up run as their Q4_0 blocks; a mixture of experts'
    attention does too while its experts (no int4 expert kernel) are dequantized to float at load."""
    arch, model = tiny_model(case)
    path = tmp_path / f"{case}.gguf"
    write_gguf(path, arch, model, GGMLQuantizationType.Q4_0)
    assert {"layers.0.qkv_proj", "layers.0.o_proj"} <= GGUFFile(path).native_projections().keys()
    llm = LLM(str(path), quantization="gguf", dtype="float32", cpu_kv_cache_gib=0.01)
    layer = llm.engine.executor.runner.model.layers[0]
    assert type(layer.qkv_proj).__name__ == "Int4WeightOnlyLinear"
    if case == "phi3":
        assert type(layer.gate_up_proj).__name__ == "Int4WeightOnlyLinear"
    else:
        assert layer.moe.w_gate_up.dtype == torch.float32
    prompts = [random_prompt(40, model.config.vocab_size, 1)]
    # the int4 kernel's bf16 activations: near the dequantized weights' logprobs, far below a wrong layout's gap
    assert logprob_gap(llm, dequantized_reference(model, GGMLQuantizationType.Q4_0), prompts) < 0.1


def test_q4_k_experts_dequantize_to_what_gguf_reads(tmp_path):
    """A merged [experts, rows, cols] Q4_K tensor (any bytes with finite fp16 scales are valid super-blocks)
    splits into each expert's weight exactly as gguf dequantizes the whole."""
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(3, 4, 144), dtype=np.uint8)
    raw[..., 0:4] = np.array([0.01, 0.02], dtype=np.float16).view(np.uint8)  # d and dmin of each super-block
    path = tmp_path / "q4k-experts.gguf"
    writer = GGUFWriter(str(path), "qwen3moe")
    writer.add_head_count(4)
    writer.add_tensor("blk.0.ffn_gate_exps.weight", raw, raw_shape=raw.shape, raw_dtype=GGMLQuantizationType.Q4_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    expected = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType.Q4_K).reshape(3, 4, 256))
    weights = dict(GGUFFile(path).iter_weights())
    for e in range(3):
        assert torch.equal(weights[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"], expected[e])
