"""GGUF files written the way llama.cpp's converter writes them load into the same network."""
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, quants
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM
from transformers.convert_slow_tokenizer import bytes_to_unicode

from fasterllm import LLM
from gguf_random_blocks import random_blocks

HEADS, KV_HEADS, HIDDEN, LAYERS, VOCAB, FFN = 4, 2, 64, 2, 128, 128
EOS = VOCAB - 1
GGUF_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
              "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
              "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
PERMUTED_ARCHS = ("llama", "mistral")  # llama.cpp's converter reorders Q/K rows for these, not for Qwen


def randomized(model):
    with torch.no_grad():  # weights big enough that attention is far from uniform
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() > 1 else 1.0) + (1.0 if p.dim() == 1 else 0.0))
    return model.eval()


SHAPE = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
             num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=256,
             rms_norm_eps=1e-5, tie_word_embeddings=False, eos_token_id=EOS)


@pytest.fixture(scope="module")
def tiny_llama():
    torch.manual_seed(0)
    return randomized(LlamaForCausalLM(LlamaConfig(**SHAPE, rope_theta=10000.0)))


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """The row order llama.cpp's convert_hf_to_gguf.py gives Q and K (pairs interleaved per head)."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def gpt2_vocabulary(writer: GGUFWriter) -> None:
    """A byte-level BPE vocabulary of VOCAB tokens, the last one the eos."""
    writer.add_tokenizer_model("gpt2")
    byte_chars = list(bytes_to_unicode().values())
    writer.add_token_list(byte_chars[:VOCAB - 1] + ["<|endoftext|>"])
    writer.add_token_types([1] * (VOCAB - 1) + [3])
    writer.add_token_merges([])
    writer.add_eos_token_id(EOS)


def write_gguf(path, model, qtype, arch="llama", vocabulary=gpt2_vocabulary, block_types=None):
    """The model's tensors as llama.cpp's converter writes them, and the tokenizer metadata vocabulary(writer)
    writes; returns what the tensors dequantize to, in Hugging Face names and row order. block_types: GGUF module
    ("attn_v", "output") -> a type whose tensors are written as random blocks of it instead (gguf_random_blocks.py:
    the gguf package cannot quantize k-quants)."""
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(model.config.hidden_size)
    writer.add_feed_forward_length(model.config.intermediate_size)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    vocabulary(writer)
    reference = {}  # what the file's weights dequantize to, in Hugging Face names and row order
    rng = np.random.default_rng(0)
    for name, tensor in model.state_dict().items():
        data = tensor.numpy().astype(np.float32)
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        elif name == "lm_head.weight":
            gguf_name = "output.weight"
        else:
            parts = name.split(".")  # model.layers.N.<module...>.weight
            gguf_name = f"blk.{parts[2]}.{GGUF_NAMES['.'.join(parts[3:-1])]}.{parts[-1]}"
        stored = data
        module = gguf_name.split(".")[2] if gguf_name.startswith("blk.") else ""
        if arch in PERMUTED_ARCHS and module in ("attn_q", "attn_k"):
            stored = llama_cpp_permute(data, HEADS if module == "attn_q" else KV_HEADS)
        kind = qtype if data.ndim == 2 else GGMLQuantizationType.F32
        if block_types and (module or gguf_name.split(".")[0]) in block_types:
            kind = GGMLQuantizationType[block_types[module or gguf_name.split(".")[0]]]
            packed = random_blocks(kind.name, *stored.shape, rng, magnitude=0.3)
        else:
            packed = quants.quantize(stored, kind)
        writer.add_tensor(gguf_name, packed, raw_dtype=kind)
        restored = quants.dequantize(packed, kind).reshape(stored.shape)
        if stored is not data:  # back to HF order for the reference model
            n = HEADS if module == "attn_q" else KV_HEADS
            restored = restored.reshape(n, -1, 2, *restored.shape[1:]).swapaxes(1, 2).reshape(restored.shape)
        reference[name] = torch.from_numpy(np.ascontiguousarray(restored))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return reference


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"])
def test_gguf_types_and_qk_permutation_give_the_reference_logits(tmp_path, tiny_llama, qtype):
    path = tmp_path / f"tiny-{qtype}.gguf"
    reference = LlamaForCausalLM(tiny_llama.config).eval()
    reference.load_state_dict(write_gguf(path, tiny_llama, GGMLQuantizationType[qtype]))
    assert_generates_as(path, reference)


def test_a_qwen3_gguf_runs_its_query_and_key_norms(tmp_path):
    torch.manual_seed(0)
    model = randomized(Qwen3ForCausalLM(Qwen3Config(**SHAPE, head_dim=HIDDEN // HEADS,  # the base write_gguf writes
                                                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0})))
    path = tmp_path / "tiny-qwen3.gguf"
    reference = Qwen3ForCausalLM(model.config).eval()
    reference.load_state_dict(write_gguf(path, model, GGMLQuantizationType.F16, arch="qwen3"))
    assert "blk.0.attn_q_norm.weight" in {t.name for t in GGUFReader(str(path)).tensors}
    assert_generates_as(path, reference)


def assert_generates_as(path, reference, **engine_args):
    """Our greedy tokens and their logprobs from the GGUF file equal the reference model's; returns our LLM."""
    llm = LLM(str(path), dtype="float32", cpu_kv_cache_gib=0.01, **engine_args)
    ids = [int(t) for t in torch.randint(0, VOCAB - 1, (40,), generator=torch.Generator().manual_seed(1))]
    with torch.no_grad():
        ref_tokens = reference.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                                        pad_token_id=EOS)[0, len(ids):].tolist()
    from fasterllm import SamplingParams

    ours = llm.generate(ids, SamplingParams(temperature=0, max_tokens=12, logprobs=1), use_tqdm=False)[0].outputs[0]
    n = len(ours.token_ids)
    assert ours.token_ids == ref_tokens[:n]
    with torch.no_grad():
        ref_logprobs = reference(torch.tensor([ids + ours.token_ids])).logits[0].log_softmax(-1)
    for i, (token, position) in enumerate(zip(ours.token_ids, ours.logprobs)):
        assert position[token].logprob == pytest.approx(ref_logprobs[len(ids) - 1 + i, token].item(), abs=1e-3)
    return llm


PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
# GGUF module -> type. "Q4_K_M-like": Q4_K_M's attention (q, k Q4_K; v Q6_K) and head (Q6_K), and mixes in the FFN
# too, so that every projection runs as 8-bit codes (the int4 layer's CPU kernel computes in bf16: not tight)
K_QUANT_FILES = {
    "Q8_0": {**dict.fromkeys(PROJECTIONS, "Q8_0"), "output": "Q8_0"},
    "Q5_K": {**dict.fromkeys(PROJECTIONS, "Q5_K"), "output": "Q5_K"},
    "Q6_K": {**dict.fromkeys(PROJECTIONS, "Q6_K"), "output": "Q6_K"},
    "Q4_K_M-like": {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q8_0", "ffn_gate": "Q4_K",
                    "ffn_up": "Q5_K", "ffn_down": "Q6_K", "output": "Q6_K"},
}


@pytest.mark.parametrize("file_kind", K_QUANT_FILES)
def test_k_quant_projections_and_head_run_as_stored_with_the_dequantized_models_logits(tmp_path, file_kind):
    """quantization='gguf' on a file whose projections and head are Q8_0, Q5_K, Q6_K or fused mixes of them with
    Q4_K: every one runs as its stored 8-bit codes (no float weight kept), and fp32 logits are the float model's."""
    torch.manual_seed(0)
    model = randomized(LlamaForCausalLM(LlamaConfig(**{**SHAPE, "hidden_size": 256, "intermediate_size": 256},
                                                    rope_theta=10000.0)))  # k-quants: 256 inputs a super-block
    path = tmp_path / f"tiny-{file_kind}.gguf"
    reference = LlamaForCausalLM(model.config).eval()
    reference.load_state_dict(write_gguf(path, model, GGMLQuantizationType.F32, block_types=K_QUANT_FILES[file_kind]))
    llm = assert_generates_as(path, reference, quantization="gguf")
    decoder = llm.engine.executor.runner.model
    fused = {"qkv_proj": ("attn_q", "attn_k", "attn_v"), "o_proj": ("attn_output",),
             "gate_up_proj": ("ffn_gate", "ffn_up"), "down_proj": ("ffn_down",), "lm_head": ("output",)}
    for layer in (*decoder.layers, decoder):
        for name, parts in fused.items():
            if name == "lm_head" and layer is not decoder or name != "lm_head" and layer is decoder:
                continue
            linear = getattr(layer, name)
            assert type(linear).__name__ == "Uint8GroupedLinear" and not hasattr(linear, "weight"), name
            types = {K_QUANT_FILES[file_kind][part] for part in parts}
            assert linear.group_size == (16 if "Q6_K" in types else 32), name
            assert linear.codes.dtype == torch.uint8
    # the same file dequantized to float: the same prompt logprobs
    floats = LLM(str(path), dtype="float32", cpu_kv_cache_gib=0.01)
    from fasterllm import SamplingParams

    prompt = [int(t) for t in torch.randint(0, VOCAB - 1, (24,), generator=torch.Generator().manual_seed(2))]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=5)
    ours, theirs = (engine.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].prompt_logprobs[1:]
                    for engine in (llm, floats))
    for mine, float_position in zip(ours, theirs):
        assert mine.keys() == float_position.keys()
        for token, logprob in mine.items():
            # fp32 sums in another order (oneDNN's packed float weight, ours in blocks of rows), through random
            # weights whose logits reach +-40: up to 4e-4 measured
            assert logprob.logprob == pytest.approx(float_position[token].logprob, abs=1e-3)


def test_projections_in_types_without_a_native_layout_run_as_int8_and_the_error_names_them(tmp_path):
    """A Q5_0 projection (no native layout) is dequantized and runs as int8 beside the Q8_0 ones; a file with no
    projection in a native type is refused by name with the fix."""
    torch.manual_seed(0)
    model = randomized(LlamaForCausalLM(LlamaConfig(**SHAPE, rope_theta=10000.0)))
    path = tmp_path / "tiny-q5_0.gguf"
    write_gguf(path, model, GGMLQuantizationType.Q5_0, block_types={"attn_output": "Q8_0", "ffn_down": "Q8_0"})
    layer = LLM(str(path), quantization="gguf", cpu_kv_cache_gib=0.01).engine.executor.runner.model.layers[0]
    assert type(layer.o_proj).__name__ == "Uint8GroupedLinear"
    assert type(layer.qkv_proj).__name__ == "Int8WeightOnlyLinear"
    path = tmp_path / "tiny-f16.gguf"
    write_gguf(path, model, GGMLQuantizationType.F16)
    with pytest.raises(ValueError, match="quantization='gguf' runs Q4_0/Q4_1/Q4_K/Q5_K/Q6_K/Q8_0 GGUF blocks as "
                                         "stored, but .*tiny-f16.gguf is a GGUF file with no projection in "
                                         "Q4_0/Q4_1/Q4_K/Q5_K/Q6_K/Q8_0 blocks; use quantization='int4'"):
        LLM(str(path), quantization="gguf", cpu_kv_cache_gib=0.01)


def test_unsupported_architecture_and_tensor_type_are_named(tmp_path, tiny_llama):
    path = tmp_path / "gpt2.gguf"
    write_gguf(path, tiny_llama, GGMLQuantizationType.F32, arch="gpt2")
    with pytest.raises(ValueError, match="GGUF architecture 'gpt2' in gpt2.gguf is not supported; supported: gemma2, "
                                         "gemma3, llama, mistral, olmoe, phi3, qwen2, qwen2moe, qwen3, qwen3moe"):
        LLM(str(path))
    path = tmp_path / "f64.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_head_count(HEADS)
    writer.add_tensor("token_embd.weight", np.zeros((VOCAB, HIDDEN), dtype=np.float64))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    from fasterllm.loader.gguf_checkpoint import GGUFFile

    with pytest.raises(ValueError, match="'token_embd.weight' in f64.gguf has type F64"):
        list(GGUFFile(path).iter_weights())
    with pytest.raises(ValueError, match="f64.gguf lacks the metadata key 'llama.embedding_length'"):
        LLM(str(path))


def test_hub_id_resolves_through_the_local_cache_offline(tmp_path, tiny_llama, monkeypatch):
    import huggingface_hub.constants

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--someone--tiny-llama"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    write_gguf(snapshot / "tiny.gguf", tiny_llama, GGMLQuantizationType.F16)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    llm = LLM("someone/tiny-llama", dtype="float32", cpu_kv_cache_gib=0.01)
    assert llm.engine.source.path == snapshot / "tiny.gguf"
    with pytest.raises(FileNotFoundError, match="'someone/other' is not in the local Hugging Face cache"):
        LLM("someone/other")
