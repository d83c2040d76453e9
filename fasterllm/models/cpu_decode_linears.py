"""A decoder layer's projection as the C++ decode stacks take it (kernels/native/cpu/linears.h): its tensors and the
kind of product its Python layer runs, so a stack multiplies it by the same operator (models/llama_cpu_decode.py,
models/seq2seq_cpu_decode.py)."""
from __future__ import annotations

import torch
from torch import nn

from fasterllm.kernels.native import cpu_gemv
from fasterllm.layers.linear import PackedCPULinear, TiledCPULinear
from fasterllm.layers.quantization.int4 import Int4WeightOnlyLinear
from fasterllm.layers.quantization.int8 import Int8WeightOnlyLinear
from fasterllm.layers.quantization.uint8_grouped import Uint8GroupedLinear

# linears.h's kinds
INT8, INT4, INT4_INT8_INPUTS, UINT8_GROUPED, ONEDNN, PLAIN, FLOAT_TILES = range(7)
NONE = torch.empty(0)  # an absent tensor (a bias, a norm), as the stacks read it


def linear_arguments(linear: nn.Module) -> tuple[list[torch.Tensor], int] | None:
    """(codes, scales, minimums, bias; a float layer: its weight, two empty tensors, its bias; an empty tensor for no
    bias) and the kind of a projection the C++ stacks multiply as the layer would, or None."""
    bias = getattr(linear, "bias", None)
    bias = NONE if bias is None else bias
    if type(linear) is PackedCPULinear:
        return [linear.packed_weight, NONE, NONE, bias], ONEDNN
    if type(linear) is TiledCPULinear:
        return [linear.tiles.weight, NONE, NONE, bias], FLOAT_TILES
    if type(linear) is nn.Linear:
        return [linear.weight, NONE, NONE, bias], PLAIN
    weights = getattr(linear, "native", None)
    if weights is None:
        return None
    if type(linear) is Int8WeightOnlyLinear:
        return [weights.codes, weights.scales, NONE, bias], INT8
    if type(linear) is Int4WeightOnlyLinear:
        return [weights.codes, weights.scales, weights.minimums, bias], (
            INT4_INT8_INPUTS if cpu_gemv.int4_int8_inputs() else INT4)
    if type(linear) is Uint8GroupedLinear:
        return [weights.codes, weights.scales, weights.minimums, bias], UINT8_GROUPED
    return None


def stack_linears(linears: list[nn.Module]) -> tuple[list[torch.Tensor], list[int]] | None:
    """The projections' tensors, four each, and their (kind, output rows) pairs, in order; None where one of them is
    not a projection the stacks run."""
    tensors, kinds = [], []
    for linear in linears:
        arguments = linear_arguments(linear)
        if arguments is None:
            return None
        tensors += arguments[0]
        kinds += [arguments[1], linear.out_features]
    return tensors, kinds
