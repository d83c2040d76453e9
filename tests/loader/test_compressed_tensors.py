"""compressed-tensors checkpoints run as stored. Each is written by the compressed-tensors library itself (its
quantization config applied to a tiny Llama, scales from each weight's min/max through its calculate_qparams, its
ModelCompressor packing and saving) and dequantized by its own decompress_model: that float model is the reference.
The loader's codes times scales equal the library's dequantized weights, the engine's logprobs match transformers on
them, and what it does not run is an error naming it."""
from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "parity"))
from parity_utils import TINY_SPECS, assert_prompt_logprobs_match, build_tiny_model, random_prompt  # noqa: E402

from fasterllm import LLM  # noqa: E402
from fasterllm.loader.prequantized import stored_quantization  # noqa: E402

pytest.importorskip("transformers")
ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors import ModelCompressor  # noqa: E402
from compressed_tensors.quantization import (  # noqa: E402
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    apply_quantization_config,
    preset_name_to_scheme,
)
from compressed_tensors.quantization.utils import calculate_qparams  # noqa: E402

SPEC = next(s for s in TINY_SPECS if s.name == "llama3_gqa")
INT4 = dict(num_bits=4, type="int")
# name -> (scheme, the library's format, the layer the projections become, logprob tolerance against the float model)
SCHEMES = {
    "W8A8": (preset_name_to_scheme("W8A8", ["Linear"]), "int-quantized", "W8A8Linear", 0.15),
    "W8A16": (QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=8, type="int", symmetric=True, strategy="channel")), "int-quantized", "Int8WeightOnlyLinear", 0.08),
    "W4A16 g64 symmetric": (QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        **INT4, symmetric=True, strategy="group", group_size=64)), "pack-quantized", "Int4WeightOnlyLinear", 0.08),
    "W4A16 g32 zero points": (QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        **INT4, symmetric=False, strategy="group", group_size=32)), "pack-quantized", "Int4WeightOnlyLinear", 0.08),
    "W4A16 per channel": (QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        **INT4, symmetric=False, strategy="channel")), "pack-quantized", "Int4WeightOnlyLinear", 0.08),
}
GPU_SCHEMES = {  # the GPU's layers (bf16): name -> (scheme, format, layer)
    "W8A8": (SCHEMES["W8A8"][0], "int-quantized", "W8A8GPULinear"),
    "W4A16 g64 symmetric": (*SCHEMES["W4A16 g64 symmetric"][:2], "Int4GPULinear"),
    "FP8": (preset_name_to_scheme("FP8_DYNAMIC", ["Linear"]), "float-quantized", "FP8Linear"),
}


def write_compressed(directory: Path, model, scheme: QuantizationScheme, quantization_format: str) -> dict:
    """Save a copy of model quantized with scheme (the output head ignored) in the library's format over the float
    checkpoint in directory; load the library's dequantized weights into model (the reference). Returns them."""
    quantized = copy.deepcopy(model)
    apply_quantization_config(quantized, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    with torch.no_grad():
        for module in quantized.modules():
            args = getattr(getattr(module, "quantization_scheme", None), "weights", None)
            if args is None:
                continue
            weight = module.weight
            if args.strategy == "group":
                grouped = weight.view(weight.shape[0], -1, args.group_size)
                low, high = grouped.amin(-1), grouped.amax(-1)
            elif args.strategy == "channel":
                low, high = weight.amin(1, keepdim=True), weight.amax(1, keepdim=True)
            else:
                low, high = weight.amin().reshape(1), weight.amax().reshape(1)
            scale, zero_point = calculate_qparams(low, high, args)
            module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.copy_(zero_point.reshape(module.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(quantized, quantization_format=quantization_format)
    compressor.compress_model(quantized)
    for old in directory.glob("*.safetensors"):
        old.unlink()
    quantized.save_pretrained(directory)
    compressor.update_config(directory)
    compressor.decompress_model(quantized)
    dequantized = {name: tensor for name, tensor in quantized.state_dict().items() if name.endswith(".weight")}
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            tensor.copy_(dequantized[name])
    return dequantized


def assert_logprobs_match(llm: LLM, model, tolerance: float) -> None:
    """The engine's prompt logprobs against transformers' fp32 on the dequantized weights (the CPU)."""
    assert_prompt_logprobs_match(llm, model, [random_prompt(n, SPEC.vocab_size, 500 + n) for n in (6, 21)], tolerance)


@pytest.mark.parametrize("name", list(SCHEMES))
def test_a_compressed_tensors_checkpoint_runs_as_its_dequantized_weights(tmp_path, name):
    scheme, quantization_format, layer, tolerance = SCHEMES[name]
    model = build_tiny_model(SPEC, tmp_path)
    dequantized = write_compressed(tmp_path, model, scheme, quantization_format)
    stored = dict(stored_quantization(tmp_path).weights(tmp_path))
    module = "model.layers.1.self_attn.k_proj"  # 32 outputs: four words of packed zero points
    if layer == "Int4WeightOnlyLinear":  # the loader's unpacking against the library's
        codes, scales, minimums = (stored[f"{module}.{leaf}"] for leaf in ("qcodes", "qscales", "qmins"))
        group = codes.shape[1] // scales.shape[1]  # held as the checkpoint's own groups
        assert codes.shape[1] == 64 and group == (scheme.weights.group_size or 64)  # per channel: the whole row
        ours = (codes.float().view(32, -1, group) * scales[..., None] + minimums[..., None]).view(32, -1)
        torch.testing.assert_close(ours, dequantized[f"{module}.weight"], rtol=1e-6, atol=1e-7)
    else:
        ours = stored[f"{module}.qweight"].float() * stored[f"{module}.qscales"][:, None]
        assert torch.equal(ours, dequantized[f"{module}.weight"])
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", num_kv_blocks=64)
    assert type(llm.engine.executor.runner.model.layers[0].qkv_proj).__name__ == layer
    # weight-only kernels multiply bf16 activations; W8A8 also rounds each token's activations to int8
    assert_logprobs_match(llm, model, tolerance)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", list(GPU_SCHEMES))
def test_on_the_gpu_a_checkpoint_runs_as_its_dequantized_weights(tmp_path, name):
    scheme, quantization_format, layer = GPU_SCHEMES[name]
    model = build_tiny_model(SPEC, tmp_path)
    write_compressed(tmp_path, model, scheme, quantization_format)
    llm = LLM(str(tmp_path), dtype="bfloat16", device="cuda", num_kv_blocks=64, gpu_memory_utilization=0.2)
    assert type(llm.engine.executor.runner.model.layers[0].qkv_proj).__name__ == layer
    assert_logprobs_match(llm, model, 0.2)  # bf16 activations (and e4m3 / int8 ones) against fp32


def test_what_the_support_does_not_cover_is_an_error_naming_it(tmp_path):
    model = build_tiny_model(SPEC, tmp_path)
    write_compressed(tmp_path, model, preset_name_to_scheme("FP8_DYNAMIC", ["Linear"]), "float-quantized")
    with pytest.raises(ValueError, match=r"\(compressed-tensors FP8\) runs as 'fp8', which has no CPU kernels"):
        LLM(str(tmp_path), device="cpu", num_kv_blocks=16)
    config_path = tmp_path / "config.json"
    config = json.loads(config_path.read_text())
    quantization = config["quantization_config"]
    group = quantization["config_groups"]["group_0"]
    static = {**group, "input_activations": {**group["input_activations"], "dynamic": False, "strategy": "tensor"}}
    for change, message in (({"config_groups": {"group_0": static}}, "input activations .*'dynamic': False"),
                            ({"ignore": ["lm_head", "model.layers.0.mlp.down_proj"]}, r"ignore=\['lm_head', "),
                            ({"config_groups": {"group_0": group, "group_1": group}}, "2 config groups")):
        config_path.write_text(json.dumps({**config, "quantization_config": {**quantization, **change}}))
        with pytest.raises(ValueError, match=f"compressed-tensors checkpoint with .*{message}.*not supported; "
                                             "supported: compressed-tensors checkpoints of one scheme"):
            LLM(str(tmp_path), device="cpu", num_kv_blocks=16)
    config_path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="is a compressed-tensors FP8 checkpoint, which runs as stored; "
                                         "quantization='int8' cannot apply"):
        LLM(str(tmp_path), device="cpu", quantization="int8", num_kv_blocks=16)
