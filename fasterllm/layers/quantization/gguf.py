"""Linears that load a GGUF's Q4_0 / Q4_1 / Q4_K blocks as they are stored, then run as int4. A GPTQ, AWQ or
compressed-tensors W4A16 checkpoint's codes take the same path (loader/prequantized.py and compressed_tensors.py unpack
them into the same three tensors).

Before loading, every projection stored so becomes a GGUFQ4Linear whose parameters (qcodes, qscales, qmins)
receive the unpacked blocks (loader/gguf_blocks.py) through the model's ordinary load_weights:
each is indexed by output row, so fusing Q/K/V or gate/up and undoing llama.cpp's Q/K row order
act on them as on a float weight. After loading they repack into Int4WeightOnlyLinear: the codes
are kept; fp16 scales and minimums are exact in fp32 and round once to bf16 where the kernel computes in bf16
(on the CPU always, on a GPU in a bf16 run).
"""
from __future__ import annotations

import torch
from torch import nn

from fasterllm.layers.linear import replace_linears
from fasterllm.layers.quantization.int4 import GROUP_SIZE


class GGUFQ4Linear(nn.Module):
    """Holds a projection's GGUF blocks (or GPTQ / AWQ codes) while the checkpoint loads; not meant to run."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        rows, cols = linear.out_features, linear.in_features
        device = linear.weight.device
        self.dtype = linear.weight.dtype
        self.qcodes = nn.Parameter(torch.empty(rows, cols, dtype=torch.uint8, device=device), requires_grad=False)
        groups = (rows, cols // GROUP_SIZE)
        self.qscales = nn.Parameter(torch.empty(groups, device=device), requires_grad=False)
        self.qmins = nn.Parameter(torch.empty(groups, device=device), requires_grad=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("GGUFQ4Linear holds blocks during loading only; quantize_model(model, 'gguf', ...) "
                           "repacks it before the first forward")


def prepare_gguf_linears(model: nn.Module, modules: frozenset[str] | None = None) -> None:
    """Before load_weights: the projections of the decoder layers take 4-bit blocks (modules: only those named, as
    "layers.3.qkv_proj"; None: all); the others and the output head (often other GGUF types) keep float weights."""
    if modules is None:
        replace_linears(model.layers, GGUFQ4Linear)
        return
    for index, layer in enumerate(model.layers):
        for name, child in list(layer.named_children()):
            if isinstance(child, nn.Linear) and f"layers.{index}.{name}" in modules:
                setattr(layer, name, GGUFQ4Linear(child))


def repack_gguf_linears(model: nn.Module, int4_linear) -> None:
    """Each held projection as int4_linear (the device's int4 layer) over the same codes."""
    replace_linears(model, lambda held: int4_linear(held.qcodes, held.qscales, held.qmins, held.bias, held.dtype),
                    kind=GGUFQ4Linear)
