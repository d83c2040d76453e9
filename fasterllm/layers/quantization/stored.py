"""Linears that load a pre-quantized checkpoint's codes as stored (loader/prequantized.py, loader/compressed_tensors.py),
then run as the layer of its layout: "int4" (GPTQ, AWQ, compressed-tensors W4A16: 4-bit codes, scales and minimums
in groups of 32, held by gguf.py's GroupedCodesLinear), "int8" / "w8a8" (int8 codes per output channel) or "fp8" (e4m3
codes per output channel), held by StoredCodesLinear.

The holders' tensors are indexed by output row, so the model's ordinary load_weights fuses Q/K/V and gate/up on them
as on a float weight. The output head is not held: these checkpoints store it float.
"""
from __future__ import annotations

import torch
from torch import nn

from fasterllm.layers.linear import replace_linears
from fasterllm.layers.quantization.gguf import prepare_gguf_linears, repack_gguf_linears

CODE_DTYPES = {"int8": torch.int8, "w8a8": torch.int8, "fp8": torch.float8_e4m3fn}


class StoredCodesLinear(nn.Module):
    """Holds a projection's codes [N, K] and fp32 scales [N] while the checkpoint loads; not meant to run."""

    def __init__(self, linear: nn.Linear, code_dtype: torch.dtype):
        super().__init__()
        device = linear.weight.device
        self.dtype = linear.weight.dtype
        self.qweight = nn.Parameter(torch.empty(linear.out_features, linear.in_features, dtype=code_dtype,
                                                device=device), requires_grad=False)
        self.qscales = nn.Parameter(torch.empty(linear.out_features, device=device), requires_grad=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("StoredCodesLinear holds codes during loading only; quantize_model repacks it before the "
                           "first forward")


def prepare_stored_linears(model: nn.Module, layout: str) -> None:
    """Before load_weights: the decoder layers' projections take the codes of layout."""
    if layout == "int4":
        prepare_gguf_linears(model)
    else:
        replace_linears(model.layers, lambda linear: StoredCodesLinear(linear, CODE_DTYPES[layout]))


def repack_stored_linears(model: nn.Module, layout: str, make) -> None:
    """Each held projection as make(...): int4 holders give (codes, scales, minimums, bias, dtype), code holders
    (qweight, scales, bias, dtype)."""
    if layout == "int4":
        repack_gguf_linears(model, {"int4": make})
    else:
        replace_linears(model, lambda held: make(held.qweight.data, held.qscales.data, held.bias, held.dtype),
                        kind=StoredCodesLinear)
