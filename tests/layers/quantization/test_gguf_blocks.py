"""GGUF blocks kept as stored (Q4_0/Q4_1/Q4_K as int4, Q5_K/Q6_K/Q8_0 as 8-bit codes): unpacked without rounding,
Q/K rows reordered like the float weights, multiplied by the int4 kernel as their dequantized values; a mix of Q4_K
and Q8_0 runs each projection as stored; refused for other checkpoints."""
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants
from tokenizers import Tokenizer, models
from transformers import LlamaConfig, LlamaForCausalLM

from fasterllm import LLM, SamplingParams
from fasterllm.layers.quantization.gguf import BlockLayout
from fasterllm.layers.quantization.int4 import Int4WeightOnlyLinear
from fasterllm.loader.gguf_blocks import NATIVE_GROUP_SIZES, block_layout, dequantize_blocks, unpack_blocks
from fasterllm.loader.gguf_checkpoint import GGUFFile
from fasterllm.loader.model_source import default_model_path
from gguf_random_blocks import random_blocks


def dequantized(codes, scales, minimums):
    group = codes.shape[1] // scales.shape[1]
    return codes.float() * scales.repeat_interleave(group, dim=1) + minimums.repeat_interleave(group, dim=1)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_blocks_unpack_to_exactly_what_gguf_dequantizes_and_the_kernel_multiplies_them(kind):
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((48, 128)).astype(np.float32)
    raw = quants.quantize(weight, GGMLQuantizationType[kind])
    reference = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType[kind]).reshape(48, 128))
    codes, scales, minimums = unpack_blocks(raw, kind, (48, 128))
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 15
    assert torch.equal(dequantized(codes, scales, minimums), reference)
    assert torch.equal(dequantize_blocks(raw, kind, (48, 128)), reference)  # what a float load of the file reads
    x = torch.randn(3, 128)
    got = Int4WeightOnlyLinear(codes, scales, minimums, None, native=False)(x)
    # torch's CPU kernel multiplies in bf16: bf16 inputs, scales and zeros (centred at code 8), one bf16 rounding out
    # (our C++ kernel is checked against exact products in tests/kernels/test_cpu_gemv.py)
    bf16 = lambda t: t.bfloat16().float()  # noqa: E731
    zeros = bf16(minimums + 8 * scales).repeat_interleave(32, dim=1)
    kernel_weight = (codes.float() - 8) * bf16(scales).repeat_interleave(32, dim=1) + zeros
    torch.testing.assert_close(got, bf16(x) @ kernel_weight.t(), rtol=2 ** -7, atol=1e-3)
    assert got.dtype == torch.float32


def test_smollm2_blocks_with_qk_rows_reordered_equal_the_float_weights():
    gguf_file = GGUFFile(default_model_path())
    layouts = gguf_file.native_projections()
    assert len(layouts) == 4 * 30 and set(layouts.values()) == {block_layout(("Q4_1",))}  # every projection: Q4_1
    wanted = ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.mlp.down_proj")
    floats = {name: w for name, w in gguf_file.iter_weights() if name.removesuffix(".weight") in wanted}
    parts = {name: w for name, w in gguf_file.iter_weights(keep_native_blocks=True) if name.rsplit(".", 1)[0] in wanted}
    for module in wanted:
        blocks = dequantized(parts[f"{module}.qcodes"], parts[f"{module}.qscales"], parts[f"{module}.qmins"])
        torch.testing.assert_close(blocks, floats[f"{module}.weight"], rtol=0, atol=1e-6)


def test_gguf_quantization_is_refused_for_a_checkpoint_that_is_not_gguf(tmp_path):
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    Tokenizer(models.WordLevel({f"w{i}": i for i in range(64)}, unk_token="w0")).save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match="quantization='gguf' runs Q4_0/Q4_1/Q4_K/Q5_K/Q6_K/Q8_0 GGUF blocks as "
                                         "stored, but .* is a hf checkpoint, not a GGUF file; use "
                                         "quantization='int4'"):
        LLM(str(tmp_path), quantization="gguf", num_kv_blocks=4)


def q4_k_bytes(weight: np.ndarray) -> np.ndarray:
    """A [rows, cols] weight as Q4_K super-blocks (llama.cpp's documented layout, written here): per 32 weights a
    6-bit scale and min relative to the super-block's fp16 d and dmin, codes 0..15."""
    rows, cols = weight.shape
    sub = weight.reshape(rows, cols // 256, 8, 32)
    low, high = np.minimum(sub.min(-1), 0), sub.max(-1)
    d = ((high - low) / 15).max(-1, keepdims=True).astype(np.float16) / np.float16(63)
    dmin = (-low).max(-1, keepdims=True).astype(np.float16) / np.float16(63)
    sc = np.clip(np.round((high - low) / 15 / d.astype(np.float32)), 1, 63).astype(np.int64)
    m = np.clip(np.round(-low / np.maximum(dmin.astype(np.float32), 1e-12)), 0, 63).astype(np.int64)
    scale, minimum = d.astype(np.float32) * sc, dmin.astype(np.float32) * m
    codes = np.clip(np.round((sub + minimum[..., None]) / scale[..., None]), 0, 15).astype(np.int64)
    packed = np.zeros((rows, cols // 256, 144), dtype=np.uint8)
    packed[..., 0:2] = d.view(np.uint8)
    packed[..., 2:4] = dmin.view(np.uint8)
    packed[..., 4:8] = (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6)
    packed[..., 8:12] = (m[..., :4] & 63) | ((m[..., 4:] >> 4) << 6)
    packed[..., 12:16] = (sc[..., 4:] & 0xF) | ((m[..., 4:] & 0xF) << 4)
    runs = codes.reshape(rows, cols // 256, 4, 2, 32)
    packed[..., 16:] = (runs[..., 0, :] | (runs[..., 1, :] << 4)).reshape(rows, cols // 256, 128)
    return packed.reshape(rows, -1)


def q6_k_bytes(weight: np.ndarray) -> np.ndarray:
    """A [rows, cols] weight as Q6_K super-blocks (llama.cpp's documented layout, written here): per 16 weights an
    int8 scale relative to the super-block's fp16 d, codes 0..63 centred at 32."""
    rows, cols = weight.shape
    sub = weight.reshape(rows, cols // 256, 16, 16)
    scale = np.abs(sub).max(-1) / 31
    d = (scale.max(-1, keepdims=True) / 127).astype(np.float16)
    sc = np.clip(np.round(scale / np.maximum(d.astype(np.float32), 1e-30)), -128, 127).astype(np.int8)
    step = d.astype(np.float32) * sc
    codes = np.clip(np.round(sub / np.where(step == 0, 1, step)[..., None]) + 32, 0, 63).astype(np.uint8)
    q = codes.reshape(rows, cols // 256, 2, 4, 32)  # (half, r, l): weight 32 r + l of each half of 128
    low, high = q & 0xF, q >> 4
    ql = np.concatenate([low[..., 0, :] | (low[..., 2, :] << 4), low[..., 1, :] | (low[..., 3, :] << 4)], axis=-1)
    qh = high[..., 0, :] | (high[..., 1, :] << 2) | (high[..., 2, :] << 4) | (high[..., 3, :] << 6)
    blocks = np.concatenate([ql.reshape(rows, -1, 128), qh.reshape(rows, -1, 64), sc.view(np.uint8),
                             d.view(np.uint8)], axis=-1)
    return blocks.reshape(rows, -1)


def test_q6_k_super_blocks_of_a_weight_unpack_to_exactly_what_gguf_dequantizes():
    weight = np.random.default_rng(2).standard_normal((24, 512)).astype(np.float32)
    raw = q6_k_bytes(weight)
    reference = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType.Q6_K).reshape(24, 512))
    assert torch.equal(dequantized(*unpack_blocks(raw, "Q6_K", (24, 512))), reference)
    assert (reference - torch.from_numpy(weight)).abs().max() < 0.1  # the test's quantizer: about a step of 6 bits


def test_q4_k_super_blocks_unpack_to_exactly_what_gguf_dequantizes():
    weight = np.random.default_rng(1).standard_normal((24, 512)).astype(np.float32)
    raw = q4_k_bytes(weight)
    reference = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType.Q4_K).reshape(24, 512))
    codes, scales, minimums = unpack_blocks(raw, "Q4_K", (24, 512))
    assert torch.equal(dequantized(codes, scales, minimums), reference)
    assert (reference - torch.from_numpy(weight)).abs().max() < 0.5  # the test's quantizer: about a step of 4 bits


CODE_LIMITS = {"Q4_0": 15, "Q4_1": 15, "Q4_K": 15, "Q5_K": 31, "Q6_K": 63, "Q8_0": 255}


@pytest.mark.parametrize("kind", ["Q8_0", "Q5_K", "Q6_K", "Q4_K", "Q4_0", "Q4_1"])
def test_random_blocks_unpack_bit_for_bit_to_what_gguf_dequantizes(kind):
    """Random bytes (every code, sub-scale and min pattern) with any finite fp16 d: codes * scale + minimum in fp32
    equals gguf's own dequantize bit for bit, in the type's groups and regrouped by 16 (a Q6_K fusion's)."""
    rows, cols = 6, 1024
    raw = random_blocks(kind, rows, cols, np.random.default_rng(list(CODE_LIMITS).index(kind)))
    reference = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType[kind]).reshape(rows, cols))
    assert torch.isfinite(reference).all()
    for group in (NATIVE_GROUP_SIZES[kind], 16):
        codes, scales, minimums = unpack_blocks(raw, kind, (rows, cols), group)
        assert codes.dtype == torch.uint8 and codes.shape == (rows, cols) and scales.shape == (rows, cols // group)
        assert int(codes.max()) == CODE_LIMITS[kind] and int(codes.min()) == 0  # every bit of a code read
        assert scales.dtype == minimums.dtype == torch.float32
        # every value equal (a zero's sign aside: gguf's 0 * d is -0.0 where d < 0, our 128 d - 128 d is +0.0)
        assert torch.equal(dequantized(codes, scales, minimums), reference)
    assert torch.equal(dequantize_blocks(raw, kind, (rows, cols)), reference)


def test_projection_layouts_from_part_types():
    assert block_layout(("Q4_K", "Q4_K", "Q4_1")) == block_layout(("Q4_0",)) == BlockLayout("int4", 32)
    assert block_layout(("Q8_0",)) == block_layout(("Q5_K", "Q4_K")) == BlockLayout("uint8_grouped", 32)
    assert block_layout(("Q4_K", "Q4_K", "Q6_K")) == BlockLayout("uint8_grouped", 16)  # Q4_K_M's attention
    assert block_layout(("Q4_K", "F16")) is None and block_layout(("Q3_K",)) is None
    with pytest.raises(ValueError, match="GGUF type Q3_K has no unpacker here"):
        unpack_blocks(np.zeros((1, 110), np.uint8), "Q3_K", (1, 256))


def write_mixed_gguf(path, q8_layers: set[int], q6_layers: set[int]) -> None:
    """SmolLM2's file with every ffn_down re-encoded as Q4_K, or as Q8_0 in q8_layers and Q6_K in q6_layers: the mix
    of a Q4_K_M file, which keeps some ffn_down and attn_v tensors in Q6_K (its other projections stay Q4_1: their
    576 inputs are not a multiple of the k-quants' 256)."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    reader = GGUFReader(default_model_path())
    writer = GGUFWriter(str(path), arch=reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.alignment"):
            continue
        sub_type = field.types[1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub_type)
    for tensor in reader.tensors:
        shape = [int(d) for d in reversed(tensor.shape)]
        if tensor.name.endswith("ffn_down.weight"):
            weight = dequantize_blocks(tensor.data, tensor.tensor_type.name, shape).numpy()
            layer = int(tensor.name.split(".")[1])
            if layer in q8_layers:
                kind, raw = GGMLQuantizationType.Q8_0, quants.quantize(weight, GGMLQuantizationType.Q8_0)
            elif layer in q6_layers:
                kind, raw = GGMLQuantizationType.Q6_K, q6_k_bytes(weight)
            else:
                kind, raw = GGMLQuantizationType.Q4_K, q4_k_bytes(weight)
            writer.add_tensor(tensor.name, raw, raw_shape=raw.shape, raw_dtype=kind)
        else:
            writer.add_tensor(tensor.name, np.asarray(tensor.data), raw_shape=tensor.data.shape,
                              raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_file_mixing_q4_k_q6_k_and_q8_0_runs_every_projection_as_stored(tmp_path):
    path = tmp_path / "smollm2-q4_k-mix.gguf"
    write_mixed_gguf(path, q8_layers={0, 1, 15, 29}, q6_layers={2, 3, 28})
    layouts = GGUFFile(path).native_projections()
    assert len(layouts) == 4 * 30  # the Q8_0 and Q6_K down_proj of seven layers too, as 8-bit codes
    assert layouts["layers.1.down_proj"] == BlockLayout("uint8_grouped", 32)
    assert layouts["layers.2.down_proj"] == BlockLayout("uint8_grouped", 16)
    assert layouts["layers.4.down_proj"] == BlockLayout("int4", 32)
    blocks = LLM(str(path), quantization="gguf", num_kv_blocks=64, max_model_len=256)
    layers = blocks.engine.executor.runner.model.layers
    assert type(layers[4].down_proj).__name__ == "Int4WeightOnlyLinear"  # Q4_K, as stored
    assert type(layers[1].down_proj).__name__ == "Uint8GroupedLinear"  # Q8_0, as stored
    assert type(layers[2].down_proj).__name__ == "Uint8GroupedLinear" and layers[2].down_proj.group_size == 16
    if layers[1].down_proj.native is not None:  # our C++ kernel: Q8_0's scales held in fp16 (exact), Q6_K's in fp32
        assert layers[1].down_proj.native.scales.dtype == torch.float16
        assert layers[2].down_proj.native.scales.dtype == torch.float32
    assert type(layers[1].qkv_proj).__name__ == "Int4WeightOnlyLinear"
    floats = LLM(str(path), num_kv_blocks=64, max_model_len=256)  # the same file dequantized
    prompt = floats.get_tokenizer().encode("The capital of France is Paris. The capital of Italy is Rome.")
    params = SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=0)
    ours, reference = (llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
                       for llm in (blocks, floats))
    logprobs = [torch.tensor([next(iter(e.values())).logprob for e in out.prompt_logprobs[1:]]) for out in
                (ours, reference)]
    # the int4 kernel's bf16 activations and the int8 head: within a few hundredths of the float load, on average
    assert (logprobs[0] - logprobs[1]).abs().mean() < 0.05
    assert "Paris" in blocks.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8),
                                      use_tqdm=False)[0].outputs[0].text
