"""Quantized linear layers: the method registry and the one entry point, quantize_model.

QUANTIZED_LINEARS maps a method name to {device type: factory}; a factory takes a float linear's
(weight, bias) and returns the module that replaces it. A method with no entry for a device is
refused on that device before any weight loads (check_supported). GPU classes are registered by
a "cuda" entry in a method's dict (layers/quantization/gpu.py, imported when first used).

Methods (all quantized at load from the float weights of any checkpoint, the output head included):
  int8  weight-only INT8 per output channel                         int8.py
  int4  weight-only 4-bit, groups of 32 with scale and offset        int4.py
        (the output head: weight-only INT8, see KEPT_INT8)
  w8a8  INT8 weights per channel + dynamic INT8 per-token activations w8a8.py
        (down_proj and the output head: weight-only INT8, see KEPT_INT8)
  fp8   e4m3 weights + dynamic per-token activations (Hopper GPUs)   no CPU path
  gguf  a GGUF's own blocks, no re-rounding: Q4_0/Q4_1/Q4_K projections as int4, Q5_K/Q6_K/Q8_0 and mixed
        ones as uint8_grouped (8-bit codes, groups of 16 or 32); the other linears (the output head, projections
        in other types) as int8                                      gguf.py, uint8_grouped.py
  gptq, awq, compressed-tensors  a checkpoint's own codes, run by the layer of their layout (STORED_LINEARS: int4,
        uint8_grouped, int8, w8a8 or fp8) with no re-rounding (GPTQ act-order: that layer behind InputOrderedLinear);
        the other linears (the output head) float, as stored        loader/prequantized.py, stored.py
A mixture of experts' experts (not Linear layers) become codes per output channel (EXPERT_CODES) under int8, w8a8 and
int4 (int8 codes: there is no 4-bit expert kernel) and fp8 (e4m3), read as codes by the fused MoE kernels; its
router stays float. gguf keeps the experts the file stores as it dequantized them.       experts.py
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from fasterllm.config import PREQUANTIZED_METHODS, check_method_name
from fasterllm.layers.linear import replace_linears
from fasterllm.layers.moe import SparseMoE
from fasterllm.layers.quantization.experts import quantize_stacked
from fasterllm.layers.quantization.gguf import repack_gguf_linears
from fasterllm.layers.quantization.stored import repack_stored_linears
from fasterllm.layers.quantization.int4 import Int4WeightOnlyLinear
from fasterllm.layers.quantization.int8 import Int8WeightOnlyLinear
from fasterllm.layers.quantization.uint8_grouped import Uint8GroupedLinear
from fasterllm.layers.quantization.w8a8 import W8A8Linear

LinearFactory = Callable[[torch.Tensor, "torch.Tensor | None"], nn.Module]


def _gpu():
    """The GPU layers (gpu.py), imported on first use: they need Triton, which a CPU install may lack."""
    from fasterllm.layers.quantization import gpu
    return gpu


QUANTIZED_LINEARS: dict[str, dict[str, LinearFactory]] = {
    "int8": {"cpu": Int8WeightOnlyLinear.from_float, "cuda": lambda w, b: _gpu().Int8GPULinear.from_float(w, b)},
    "int4": {"cpu": Int4WeightOnlyLinear.from_float, "cuda": lambda w, b: _gpu().Int4GPULinear.from_float(w, b)},
    "w8a8": {"cpu": W8A8Linear.from_float, "cuda": lambda w, b: _gpu().W8A8GPULinear.from_float(w, b)},
    "fp8": {"cuda": lambda w, b: _gpu().FP8Linear.from_float(w, b)},
}
QUANTIZED_LINEARS["gguf"] = QUANTIZED_LINEARS["int8"]  # the linears a GGUF stores in other types (the head)
# the layer a stored layout's codes are repacked into, per device: int4 and uint8_grouped from (codes, scales,
# minimums, bias, dtype), the others from (qweight, scales, bias, dtype)
STORED_LINEARS: dict[str, dict[str, Callable[..., nn.Module]]] = {
    "int4": {"cpu": lambda codes, scales, minimums, bias, dtype: Int4WeightOnlyLinear(codes, scales, minimums, bias),
             "cuda": lambda *blocks: _gpu().Int4GPULinear(*blocks)},
    "uint8_grouped": {"cpu": lambda codes, scales, minimums, bias, dtype: Uint8GroupedLinear(codes, scales, minimums,
                                                                                            bias),
                      "cuda": lambda *blocks: _gpu().Uint8GroupedGPULinear(*blocks)},
    "int8": {"cpu": lambda qweight, scales, bias, dtype: Int8WeightOnlyLinear(qweight, scales, bias),
             "cuda": lambda *codes: _gpu().Int8GPULinear(*codes)},
    "w8a8": {"cpu": lambda qweight, scales, bias, dtype: W8A8Linear(qweight, scales, bias),
             "cuda": lambda *codes: _gpu().W8A8GPULinear(*codes)},
    "fp8": {"cuda": lambda qweight, scales, bias, dtype: _gpu().FP8Linear(qweight, scales, bias)},
}

# Linears (by attribute name) that a method leaves as weight-only INT8 (measured on SmolLM2, RESULTS.md):
# w8a8: down_proj's input, SiLU(gate) * up, has per-token outliers that per-token INT8 rounds too coarsely
# (perplexity +1.1% with it quantized, +0.06% without). int4, w8a8: the output head decides every token
# (4 bits there: +8.5%), and llama.cpp's Q4 files keep it at 6-8 bits too. fp8: with an e4m3 head SmolLM2 on
# the H100 answered "L'Étoile" for the capital of France (vLLM keeps the head unquantized for fp8).
KEPT_INT8 = {"w8a8": ("down_proj", "lm_head"), "int4": ("lm_head",), "fp8": ("lm_head",)}
EXPERT_CODES = {"int8": torch.int8, "w8a8": torch.int8, "int4": torch.int8, "fp8": torch.float8_e4m3fn}


def check_supported(method: str | None, device: torch.device) -> None:
    """Raise a ValueError naming the method, where it runs and the fix, if it cannot run on device."""
    check_method_name(method)
    if method is None or method in PREQUANTIZED_METHODS:  # where its layout runs: check_stored_supported
        return
    if device.type not in QUANTIZED_LINEARS[method]:
        where = [m for m, devices in QUANTIZED_LINEARS.items() if device.type in devices]
        need = "an NVIDIA Hopper GPU (e4m3 through torch._scaled_mm)" if method == "fp8" else "another device"
        raise ValueError(f"quantization={method!r} has no {device.type.upper()} kernels (it needs {need}); on "
                         f"{device.type} use one of {', '.join(repr(m) for m in where) or 'none'} or drop it")
    if method == "fp8":
        _gpu().check_fp8_device(device)  # a CUDA GPU older than Hopper


def check_stored_supported(layout: str, device: torch.device, what: str) -> None:
    """Raise a ValueError naming what (the checkpoint and its scheme) if its layout has no layer on device."""
    if device.type not in STORED_LINEARS[layout]:
        raise ValueError(f"{what} runs as {layout!r}, which has no {device.type.upper()} kernels; run it on an "
                         f"NVIDIA Hopper GPU, or use a checkpoint of another scheme")
    if layout == "fp8":
        _gpu().check_fp8_device(device)


def quantize_model(model: nn.Module, method: str, device: torch.device, stored_layout: str | None = None) -> None:
    """Replace every nn.Linear under model (in place) with its quantized form for device (build_decoder has
    checked that the method runs there and made a tied head a Linear of its own); a pre-quantized checkpoint's held
    codes (stored_layout) with the layer that runs them."""
    if method == "gguf":
        repack_gguf_linears(model, {layout: STORED_LINEARS[layout][device.type]
                                    for layout in ("int4", "uint8_grouped")})
    if method in PREQUANTIZED_METHODS:  # the other linears (the head) run float, as stored
        repack_stored_linears(model, stored_layout, STORED_LINEARS[stored_layout][device.type])
        if device.type == "cuda" and stored_layout in ("w8a8", "fp8"):
            from fasterllm.layers.quantization.fused_activation import fuse_activation_quantization
            fuse_activation_quantization(model)
        return
    make = QUANTIZED_LINEARS[method][device.type]
    if method in KEPT_INT8:
        weight_only = QUANTIZED_LINEARS["int8"][device.type]
        for parent in list(model.modules()):
            for name in KEPT_INT8[method]:
                child = getattr(parent, name, None)
                if isinstance(child, nn.Linear):
                    setattr(parent, name, weight_only(child.weight.detach(), child.bias))
    replace_linears(model, lambda linear: make(linear.weight.detach(), linear.bias))
    for moe in (module for module in model.modules() if isinstance(module, SparseMoE) and method in EXPERT_CODES):
        moe.hold_codes(*(quantize_stacked(weight, EXPERT_CODES[method]) for weight in (moe.w_gate_up, moe.w_down)))
    if device.type == "cuda":  # W8A8 / FP8 projections read codes their RMSNorm or SiLU*mul wrote
        from fasterllm.layers.quantization.fused_activation import fuse_activation_quantization
        fuse_activation_quantization(model)
