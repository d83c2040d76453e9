"""Linears that load a GGUF's blocks as they are stored, then run as the layer of their layout: Q4_0 / Q4_1 / Q4_K
projections as int4 (4-bit codes), Q5_K / Q6_K / Q8_0 ones and those that mix types as uint8_grouped (8-bit codes,
uint8_grouped.py), each with no re-rounding. A GPTQ, AWQ or compressed-tensors W4A16 checkpoint's codes take the
same path as int4 (loader/prequantized.py and compressed_tensors.py unpack them into the same three tensors).

Before loading, every projection stored so becomes a GroupedCodesLinear whose parameters (qcodes, qscales, qmins)
receive the unpacked blocks (loader/gguf_blocks.py) through the model's ordinary load_weights:
each is indexed by output row, so fusing Q/K/V or gate/up and undoing llama.cpp's Q/K row order
act on them as on a float weight. One fused projection runs one layout: a mix of 4-bit and wider parts (Q4_K_M
keeps q and k in Q4_K and v in Q6_K) holds its 4-bit codes as 8-bit ones (a code 0..15 is a code 0..255) in the
smallest group of its parts (a 32-group's scale repeated over two 16-groups), rather than being split into one
layer a part: one matmul and one launch, as for every other fused projection, at the price of reading the 4-bit
parts' codes as whole bytes (q and k: about 80% of that projection's weights with grouped-query attention). The
output head, where the file stores it untied in one of these types (Q4_K_M: Q6_K), is held and run the same way,
as 8-bit codes even when 4-bit (torch's int4 CPU kernel takes only row counts divisible by 16).
After loading they repack into the layer of their layout: the codes are kept; scales and minimums are exact in fp32
(an fp16 times a small integer) and stay exact in the 8-bit layer (fp32, or fp16 where that holds every one: Q8_0,
on our C++ CPU kernel and on a GPU); the int4 layer keeps them exact on our C++ CPU kernel (in fp16 where that holds
every one: Q4_0 / Q4_1), rounds them once to bf16 where its kernel computes in bf16 (on the CPU with torch's kernel,
on a GPU in a bf16 run) and to fp16 on a GPU otherwise.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from fasterllm.layers.linear import replace_linears


@dataclass(frozen=True)
class BlockLayout:
    """The layer a projection's grouped codes run as, in groups of group_size: "int4" (codes 0..15; 32-256: int4.py)
    or "uint8_grouped" (codes 0..255; 16 or 32: uint8_grouped.py)."""
    layout: str
    group_size: int


class GroupedCodesLinear(nn.Module):
    """Holds a projection's codes, per-group scales and minimums (GGUF blocks, or GPTQ / AWQ codes) while the
    checkpoint loads, and the layout they run as; not meant to run."""

    def __init__(self, linear: nn.Linear, layout: BlockLayout):
        super().__init__()
        rows, cols = linear.out_features, linear.in_features
        if cols % layout.group_size:
            raise ValueError(f"a projection of {cols} inputs cannot hold groups of {layout.group_size} weights")
        device = linear.weight.device
        self.dtype = linear.weight.dtype
        self.layout = layout.layout
        self.qcodes = nn.Parameter(torch.empty(rows, cols, dtype=torch.uint8, device=device), requires_grad=False)
        groups = (rows, cols // layout.group_size)
        self.qscales = nn.Parameter(torch.empty(groups, device=device), requires_grad=False)
        self.qmins = nn.Parameter(torch.empty(groups, device=device), requires_grad=False)
        self.bias = linear.bias

    def fill_random(self, generator: torch.Generator, spread: float) -> None:
        """Random codes over the layout's range, scales and minimums that centre them with about this standard
        deviation (load_format='dummy')."""
        levels = 16 if self.layout == "int4" else 256
        self.qcodes.random_(0, levels, generator=generator)
        self.qscales.uniform_(0.5, 1.5, generator=generator).mul_(spread / (levels / 12 ** 0.5))
        torch.mul(self.qscales, -(levels - 1) / 2, out=self.qmins)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("GroupedCodesLinear holds blocks during loading only; quantize_model(model, 'gguf', ...) "
                           "repacks it before the first forward")


def prepare_gguf_linears(model: nn.Module, layouts: Mapping[str, BlockLayout]) -> None:
    """Before load_weights: the projections of the decoder layers take grouped codes (layouts: only those named, as
    "layers.3.qkv_proj", each in its layout, and the output head if "lm_head" is named); the others (often other GGUF
    types) keep float weights."""
    for index, layer in enumerate(model.layers):
        for name, child in list(layer.named_children()):
            layout = layouts.get(f"layers.{index}.{name}")
            if isinstance(child, nn.Linear) and layout is not None:
                setattr(layer, name, GroupedCodesLinear(child, layout))
    if "lm_head" in layouts and isinstance(getattr(model, "lm_head", None), nn.Linear):  # not tied
        model.lm_head = GroupedCodesLinear(model.lm_head, layouts["lm_head"])


def repack_gguf_linears(model: nn.Module, layers: Mapping[str, Callable[..., nn.Module]]) -> None:
    """Each held projection as layers[its layout] (the device's layer of that layout) over the same codes:
    (codes, scales, minimums, bias, dtype)."""
    replace_linears(model, lambda held: layers[held.layout](held.qcodes.data, held.qscales.data, held.qmins.data,
                                                             held.bias, held.dtype),
                    kind=GroupedCodesLinear)
