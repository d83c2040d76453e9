"""GGUF Q4_0/Q4_1 blocks kept as stored: unpacked without rounding, Q/K rows reordered like the float
weights, multiplied by the int4 kernel as their dequantized values; refused for other checkpoints."""
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants
from tokenizers import Tokenizer, models
from transformers import LlamaConfig, LlamaForCausalLM

from fasterllm import LLM
from fasterllm.layers.quantization.int4 import Int4WeightOnlyLinear
from fasterllm.loader.gguf_blocks import dequantize_q4_blocks, unpack_q4_blocks
from fasterllm.loader.gguf_checkpoint import GGUFFile
from fasterllm.loader.model_source import default_model_path


def dequantized(codes, scales, minimums):
    return codes.float() * scales.repeat_interleave(32, dim=1) + minimums.repeat_interleave(32, dim=1)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_blocks_unpack_to_exactly_what_gguf_dequantizes_and_the_kernel_multiplies_them(kind):
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((48, 128)).astype(np.float32)
    raw = quants.quantize(weight, GGMLQuantizationType[kind])
    reference = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType[kind]).reshape(48, 128))
    codes, scales, minimums = unpack_q4_blocks(raw, kind, (48, 128))
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 15
    assert torch.equal(dequantized(codes, scales, minimums), reference)
    assert torch.equal(dequantize_q4_blocks(raw, kind, (48, 128)), reference)  # what a float load of the file reads
    x = torch.randn(3, 128)
    got = Int4WeightOnlyLinear(codes, scales, minimums, None)(x)
    # the CPU kernel multiplies in bf16: bf16 inputs, scales and zeros (centred at code 8), one bf16 rounding out
    bf16 = lambda t: t.bfloat16().float()  # noqa: E731
    zeros = bf16(minimums + 8 * scales).repeat_interleave(32, dim=1)
    kernel_weight = (codes.float() - 8) * bf16(scales).repeat_interleave(32, dim=1) + zeros
    torch.testing.assert_close(got, bf16(x) @ kernel_weight.t(), rtol=2 ** -7, atol=1e-3)
    assert got.dtype == torch.float32


def test_smollm2_blocks_with_qk_rows_reordered_equal_the_float_weights():
    gguf_file = GGUFFile(default_model_path())
    assert gguf_file.projections_are_q4()
    wanted = ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.mlp.down_proj")
    floats = {name: w for name, w in gguf_file.iter_weights() if name.removesuffix(".weight") in wanted}
    parts = {name: w for name, w in gguf_file.iter_weights(keep_q4_blocks=True) if name.rsplit(".", 1)[0] in wanted}
    for module in wanted:
        blocks = dequantized(parts[f"{module}.qcodes"], parts[f"{module}.qscales"], parts[f"{module}.qmins"])
        torch.testing.assert_close(blocks, floats[f"{module}.weight"], rtol=0, atol=1e-6)


def test_gguf_quantization_is_refused_for_a_checkpoint_without_q4_blocks(tmp_path):
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    Tokenizer(models.WordLevel({f"w{i}": i for i in range(64)}, unk_token="w0")).save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match="quantization='gguf' runs Q4_0/Q4_1 GGUF blocks as stored, but .* is a hf "
                                         "checkpoint, not a GGUF file; use quantization='int4'"):
        LLM(str(tmp_path), quantization="gguf", num_kv_blocks=4)
