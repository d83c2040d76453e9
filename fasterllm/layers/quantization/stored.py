"""Linears that load a pre-quantized checkpoint's codes as stored (loader/prequantized.py, loader/compressed_tensors.py),
then run as the layer of its layout: "int4" (GPTQ, AWQ, compressed-tensors W4A16: 4-bit codes, scales and minimums
in the checkpoint's groups, 32-256 inputs wide) and "uint8_grouped" (8-bit GPTQ in groups, or asymmetric: 8-bit
codes, scales and minimums in groups of 32), both held by gguf.py's GroupedCodesLinear; "int8" / "w8a8" (int8 codes
per output channel: 8-bit GPTQ per channel, symmetric, too) or "fp8" (e4m3 codes per output channel), held by
StoredCodesLinear.

The holders' tensors are indexed by output row, so the model's ordinary load_weights fuses Q/K/V and gate/up on them
as on a float weight. The output head is not held: these checkpoints store it float.

A GPTQ act-order checkpoint's codes come with their input order (qorder, indexed by input: loader/prequantized.py sorts
the inputs by group): its layer is InputOrderedLinear, the device's grouped layer behind one index_select of the
activation's columns, so no such layer (CPU torch or C++, GPU Triton or tinygemm) needs to know of it. Projections
fused by a model share their input, so their orders must agree (the model's loader checks: INPUT_INDEXED).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from fasterllm.layers.linear import replace_linears
from fasterllm.layers.quantization.gguf import BlockLayout, GroupedCodesLinear, repack_gguf_linears

CODE_DTYPES = {"int8": torch.int8, "w8a8": torch.int8, "fp8": torch.float8_e4m3fn}
GROUPED_LAYOUTS = ("int4", "uint8_grouped")  # held as codes, scales and minimums in groups
# a held projection's tensors indexed by its input, not its output rows: one for all the projections a model fuses
INPUT_INDEXED = ("qorder",)


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

    def fill_random(self, generator: torch.Generator, spread: float) -> None:
        """Random codes and per-row scales giving weights of about this standard deviation (load_format='dummy')."""
        if self.qweight.dtype == torch.int8:
            self.qweight.random_(-127, 128, generator=generator)
            self.qscales.fill_(spread / 73.3)  # the codes' own deviation, 255 / sqrt(12)
        else:  # e4m3 codes of normal values
            self.qweight.copy_(torch.randn(self.qweight.shape, generator=generator, device=self.qweight.device))
            self.qscales.fill_(spread)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("StoredCodesLinear holds codes during loading only; quantize_model repacks it before the "
                           "first forward")


class OrderedCodesLinear(GroupedCodesLinear):
    """GroupedCodesLinear's holder with the codes' input order too: qorder int64 [K], the stored input each column of
    the codes is."""

    def __init__(self, linear: nn.Linear, layout: BlockLayout):
        super().__init__(linear, layout)
        self.qorder = nn.Parameter(torch.empty(linear.in_features, dtype=torch.int64, device=linear.weight.device),
                                   requires_grad=False)

    def fill_random(self, generator: torch.Generator, spread: float) -> None:
        """The codes' and scales' fill, in the stored input order: a random act-order checkpoint runs without the
        gather of its activation's columns (one index_select a projection) that a real one with groups pays."""
        super().fill_random(generator, spread)
        torch.arange(self.qorder.numel(), out=self.qorder)


class InputOrderedLinear(nn.Module):
    """A linear over inputs in another order: layer(x[..., order]), layer holding the weight's columns in that order."""

    def __init__(self, layer: nn.Module, order: torch.Tensor):
        super().__init__()
        self.layer, self.out_features = layer, layer.out_features
        self.register_buffer("order", order.to(torch.int64), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x.index_select(-1, self.order))


def with_input_order(layer: nn.Module, order: torch.Tensor) -> nn.Module:
    """layer, behind InputOrderedLinear unless order is the identity (a checkpoint in group order)."""
    if torch.equal(order, torch.arange(order.numel(), device=order.device)):
        return layer
    return InputOrderedLinear(layer, order)


def prepare_stored_linears(model: nn.Module, layout: str, input_order: bool,
                           held_group_size: Callable[[int], int]) -> None:
    """Before load_weights: the decoder layers' projections take the codes of layout (input_order: grouped codes with
    their input order, qorder; held_group_size: the group width a projection of so many inputs holds, the
    checkpoint's loader's)."""
    if layout in GROUPED_LAYOUTS:
        holder = OrderedCodesLinear if input_order else GroupedCodesLinear
        replace_linears(model.layers, lambda linear: holder(
            linear, BlockLayout(layout, held_group_size(linear.in_features))))
    else:
        replace_linears(model.layers, lambda linear: StoredCodesLinear(linear, CODE_DTYPES[layout]))


def repack_stored_linears(model: nn.Module, layout: str, make) -> None:
    """Each held projection as make(...): grouped holders give (codes, scales, minimums, bias, dtype), code holders
    (qweight, scales, bias, dtype); a projection with its input order behind InputOrderedLinear."""
    if layout in GROUPED_LAYOUTS:
        replace_linears(model, lambda held: with_input_order(make(held.qcodes.data, held.qscales.data,
                                                                  held.qmins.data, held.bias, held.dtype),
                                                             held.qorder.data),
                        kind=OrderedCodesLinear)
        repack_gguf_linears(model, {layout: make})
    else:
        replace_linears(model, lambda held: make(held.qweight.data, held.qscales.data, held.bias, held.dtype),
                        kind=StoredCodesLinear)
