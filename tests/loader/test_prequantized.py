"""GPTQ and AWQ checkpoints run as stored: the test writes each format's documented packing of a tiny Llama's
projections, quantized here (GPTQ: qweight packed along inputs, qzeros stored minus one in v1, fp16 scales, g_idx;
AWQ: qweight and qzeros packed along outputs in AutoAWQ's nibble order); the engine's logits equal transformers' on
the dequantized float weights (to the int4 kernel's bf16), its codes equal the test's, and what it does not run is
an error naming it."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "parity"))
from parity_utils import TINY_SPECS, assert_prompt_logprobs_match, build_tiny_model, random_prompt  # noqa: E402

from fasterllm import LLM  # noqa: E402
from fasterllm.loader.prequantized import stored_quantization  # noqa: E402

pytest.importorskip("transformers")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ: nibble j of a word holds column 8 i + AWQ_ORDER[j]


def gptq_quantize(weight: np.ndarray, group_size: int, sym: bool):
    """weight [N, K] -> (codes [K, N], zeros [G, N], fp16 scales [G, N], dequantized [N, K]): GPTQ's round to nearest
    of each group of inputs (asymmetric: min/max; symmetric: zero point 8)."""
    n, k = weight.shape
    group = k if group_size == -1 else group_size
    grouped = weight.T.reshape(k // group, group, n)
    if sym:
        scales = (np.abs(grouped).max(axis=1) * 2 / 15).astype(np.float16)
        zeros = np.full(scales.shape, 8, dtype=np.int64)
    else:
        low, high = grouped.min(axis=1), grouped.max(axis=1)
        scales = ((high - low) / 15).astype(np.float16)
        zeros = np.clip(np.round(-low / scales.astype(np.float32)), 0, 15).astype(np.int64)
    s = scales.astype(np.float32)[:, None, :]
    codes = np.clip(np.round(grouped / s) + zeros[:, None, :], 0, 15).astype(np.int64)
    dequantized = ((codes - zeros[:, None, :]) * s).reshape(k, n).T
    return codes.reshape(k, n), zeros, scales, dequantized


def pack_rows(values: np.ndarray) -> np.ndarray:
    """[R, C] codes -> int32 [R / 8, C], row 8 i + j in bits 4 j of row i (qweight)."""
    shifted = values.reshape(values.shape[0] // 8, 8, values.shape[1]) << (4 * np.arange(8))[None, :, None]
    return np.ascontiguousarray(shifted.sum(axis=1).astype(np.uint32).view(np.int32))


def pack_columns_awq(values: np.ndarray) -> np.ndarray:
    """[R, C] codes -> int32 [R, C / 8] as AutoAWQ packs them: word i holds column 8 i + AWQ_ORDER[j] in bits 4 j."""
    words = np.zeros((values.shape[0], values.shape[1] // 8), dtype=np.int64)
    for i in range(words.shape[1]):
        for j, column in enumerate(AWQ_ORDER):
            words[:, i] |= values[:, 8 * i + column] << (4 * j)
    return np.ascontiguousarray(words.astype(np.uint32).view(np.int32))


def write_quantized(directory: Path, model, group_size: int, sym: bool, checkpoint_format: str = "gptq"):
    """Save model's projections as GPTQ (checkpoint_format "gptq" or "gptq_v2") or AWQ ("awq"), the rest float,
    with the quantization_config; load the dequantized weights into model (the reference); return each projection's
    codes [K, N]."""
    from safetensors.torch import save_file

    tensors, codes_of = {}, {}
    for name, tensor in model.state_dict().items():
        module = name.removesuffix(".weight")
        if module.rsplit(".", 1)[-1] not in PROJECTIONS:
            tensors[name] = tensor.contiguous()
            continue
        codes, zeros, scales, dequantized = gptq_quantize(tensor.numpy(), group_size, sym)
        tensors[f"{module}.scales"] = torch.from_numpy(np.ascontiguousarray(scales))
        if checkpoint_format == "awq":
            tensors[f"{module}.qweight"] = torch.from_numpy(pack_columns_awq(codes))
            tensors[f"{module}.qzeros"] = torch.from_numpy(pack_columns_awq(zeros))
        else:
            stored_zeros = zeros - (1 if checkpoint_format == "gptq" else 0)
            tensors[f"{module}.qweight"] = torch.from_numpy(pack_rows(codes))
            tensors[f"{module}.qzeros"] = torch.from_numpy(np.ascontiguousarray(pack_rows(stored_zeros.T).T))
            tensors[f"{module}.g_idx"] = torch.arange(codes.shape[0], dtype=torch.int32) // (
                codes.shape[0] if group_size == -1 else group_size)
        with torch.no_grad():
            tensor.copy_(torch.from_numpy(dequantized))
        codes_of[module] = codes
    for old in directory.glob("*.safetensors"):
        old.unlink()
    save_file(tensors, str(directory / "model.safetensors"))
    config = json.loads((directory / "config.json").read_text())
    if checkpoint_format == "awq":
        config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group_size,
                                         "zero_point": True, "version": "gemm"}
    else:
        config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": group_size,
                                         "desc_act": False, "sym": sym, "checkpoint_format": checkpoint_format}
    (directory / "config.json").write_text(json.dumps(config))
    return codes_of


@pytest.mark.parametrize("group_size, sym, checkpoint_format", [(32, False, "gptq"), (64, True, "gptq"),
                                                                 (-1, False, "gptq_v2"), (32, False, "awq"),
                                                                 (64, False, "awq")])
def test_a_prequantized_checkpoint_runs_as_its_dequantized_weights(tmp_path, group_size, sym, checkpoint_format):
    spec = next(s for s in TINY_SPECS if s.name == "llama3_gqa")
    model = build_tiny_model(spec, tmp_path)
    codes_of = write_quantized(tmp_path, model, group_size, sym, checkpoint_format)
    unpacked = dict(stored_quantization(tmp_path).weights(tmp_path))
    for module, codes in codes_of.items():  # the loader's unpacking against the test's packing
        assert torch.equal(unpacked[f"{module}.qcodes"], torch.from_numpy(codes.T.astype(np.uint8)))
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", num_kv_blocks=64)
    assert type(llm.engine.executor.runner.model.layers[0].qkv_proj).__name__ == "Int4WeightOnlyLinear"
    # the int4 kernel multiplies bf16 activations: logprobs within a few hundredths of the float model's
    assert_prompt_logprobs_match(llm, model, [random_prompt(n, spec.vocab_size, 300 + n) for n in (5, 23)], 0.08)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("group_size, sym, checkpoint_format", [(-1, True, "gptq"), (64, False, "awq")])
def test_on_the_gpu_a_prequantized_checkpoint_runs_as_its_dequantized_weights(tmp_path, group_size, sym,
                                                                              checkpoint_format):
    spec = next(s for s in TINY_SPECS if s.name == "llama3_gqa")
    model = build_tiny_model(spec, tmp_path)
    write_quantized(tmp_path, model, group_size, sym, checkpoint_format)
    llm = LLM(str(tmp_path), dtype="bfloat16", device="cuda", num_kv_blocks=64, gpu_memory_utilization=0.2)
    assert type(llm.engine.executor.runner.model.layers[0].qkv_proj).__name__ == "Int4GPULinear"
    # bf16 activations against fp32
    assert_prompt_logprobs_match(llm, model, [random_prompt(23, spec.vocab_size, 323)], 0.2)


def test_what_the_support_does_not_cover_is_an_error_naming_it(tmp_path):
    spec = next(s for s in TINY_SPECS if s.name == "llama3_gqa")
    model = build_tiny_model(spec, tmp_path)
    write_quantized(tmp_path, model, 32, False)
    config_path = tmp_path / "config.json"
    config = json.loads(config_path.read_text())
    for change, message in (({"bits": 8}, "GPTQ checkpoint of bits=8, group_size=32; supported: GPTQ and AWQ checkpoints of 4-bit"),
                            ({"group_size": 16}, "bits=4, group_size=16; supported"),
                            ({"quant_method": "bitsandbytes"}, "quant_method='bitsandbytes', which is not supported"),
                            ({"quant_method": "awq", "version": "gemv"}, "AWQ checkpoint of version='gemv'")):
        config_path.write_text(json.dumps({**config, "quantization_config": {**config["quantization_config"],
                                                                             **change}}))
        with pytest.raises(ValueError, match=message):
            LLM(str(tmp_path), device="cpu", num_kv_blocks=16)
    config_path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="is a GPTQ checkpoint, which runs as stored; quantization='int8'"):
        LLM(str(tmp_path), device="cpu", quantization="int8", num_kv_blocks=16)
    # desc_act: inputs ordered by activation, a g_idx out of group order
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.0.self_attn.q_proj.g_idx"
    tensors[name] = tensors[name].flip(0).contiguous()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="orders its inputs by activation \\(desc_act"):
        LLM(str(tmp_path), device="cpu", num_kv_blocks=16)
