"""FasterLLaMA's fused activation quantization on the GPU: the RMSNorm before a W8A8 / FP8 projection and the
SiLU*mul before down_proj write the per-token quantized rows that projection's GEMM reads.

Unfused, the norm writes float rows and the projection's own quantize launch reads them back to write codes and
scales; fused, kernels/quant_activation.py's rms_norm_quantize and silu_and_mul_quantize write the codes and
scales directly: one launch and one pass over the activations fewer per projection, and the same codes (the
fused kernels round the float value to the activation dtype first, as the unfused layers do).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fasterllm.kernels.quant_activation import rms_norm_quantize, silu_and_mul_quantize
from fasterllm.layers.activation import SiluAndMul
from fasterllm.layers.norm import RMSNorm


@dataclass(frozen=True)
class QuantizedRows:
    """Token rows as per-token quantized codes: row t ~= codes[t] * scales[t]."""

    codes: torch.Tensor  # [T, K] int8 or float8_e4m3fn
    scales: torch.Tensor  # [T, 1] fp32
    dtype: torch.dtype  # the float dtype the rows stand for: the projection's output dtype


class QuantizingRMSNorm(nn.Module):
    def __init__(self, norm: RMSNorm, codes_dtype: torch.dtype):
        super().__init__()
        self.weight, self.eps, self.codes_dtype = norm.weight, norm.eps, codes_dtype

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[QuantizedRows, torch.Tensor]:
        """RMSNorm's (normed, new residual), the normed rows quantized per token."""
        codes, scales, new_residual = rms_norm_quantize(x, residual, self.weight, self.eps, self.codes_dtype)
        return QuantizedRows(codes, scales, x.dtype), new_residual


class QuantizingSiluAndMul(nn.Module):
    def __init__(self, codes_dtype: torch.dtype):
        super().__init__()
        self.codes_dtype = codes_dtype

    def forward(self, gate_up: torch.Tensor) -> QuantizedRows:
        codes, scales = silu_and_mul_quantize(gate_up, self.codes_dtype)
        return QuantizedRows(codes, scales, gate_up.dtype)


# in a decoder layer: the module (by attribute name) whose output is the input of the projection named next to it
_PRODUCERS = {"input_layernorm": "qkv_proj", "post_attention_layernorm": "gate_up_proj", "act": "down_proj"}


def fuse_activation_quantization(model: nn.Module) -> None:
    """Wherever a projection quantizes its own input (it has an activation_dtype: W8A8 and FP8 GPU layers) and
    its producer is an RMSNorm or a SiLU*mul, make the producer quantize instead (in place)."""
    for layer in list(model.modules()):
        producers = dict(_PRODUCERS)
        if getattr(layer, "pre_feedforward_layernorm", None) is not None:  # Gemma 2: this norm feeds gate_up
            producers["pre_feedforward_layernorm"] = producers.pop("post_attention_layernorm")
        for producer_name, consumer_name in producers.items():
            codes_dtype = getattr(getattr(layer, consumer_name, None), "activation_dtype", None)
            producer = getattr(layer, producer_name, None)
            if codes_dtype is None:
                continue
            if isinstance(producer, RMSNorm):
                setattr(layer, producer_name, QuantizingRMSNorm(producer, codes_dtype))
            elif isinstance(producer, SiluAndMul):
                setattr(layer, producer_name, QuantizingSiluAndMul(codes_dtype))
