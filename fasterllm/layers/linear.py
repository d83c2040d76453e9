"""CPU linear layers with weights reordered once, at load time.

A decode step on the CPU is a chain of matrix-vector products bound by memory bandwidth; oneDNN's
blocked weight layout streams about 1.5x faster than the plain row-major one (fp32 and bf16;
measured in benchmarks/RESULTS.md), and the reorder costs nothing per step. fp32 weights go one step
further where our C++ kernels are built (TiledCPULinear: the weights in tiles our own product streams
front to back, 1.3-1.5x faster than oneDNN's over a decode step's products on an AVX2 CPU, and no
slower at hundreds of rows).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from fasterllm.cpu_features import cpu_features
from fasterllm.kernels.native import cpu_extension, cpu_gemv


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """fp32 packs wherever oneDNN is built in; bf16 only where oneDNN has bf16 kernels (cpu_features): elsewhere
    the weights stay plain and F.linear multiplies them (same products, slower)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and cpu_features().onednn_bf16)


class FlatLinear(nn.Module):
    """A linear layer whose matmul maps [M, K] -> [M, N] (bias included): any leading dims of the input are
    flattened into M and restored on the output here, once for every layer kind."""

    out_features: int

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.is_contiguous():  # the decoder's flat batch already: no reshapes (3 ops a call)
            return self.matmul(x)
        shape = x.shape
        return self.matmul(x.reshape(-1, shape[-1]).contiguous()).reshape(*shape[:-1], self.out_features)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """The weight [N, K] in oneDNN's blocked layout, once, for onednn_linear."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)


def onednn_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None,
                  gelu_approximate: str | None = None) -> torch.Tensor:
    """x W^T + b over a packed weight, with GELU as oneDNN's post-op when gelu_approximate ('none' or 'tanh')."""
    if gelu_approximate is None:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed_weight, bias, "none", [], "")
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed_weight, bias, "gelu", [], gelu_approximate)


class PackedCPULinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features = weight.shape[0]
        self.packed_weight = pack_weight(weight)
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return onednn_linear(x, self.packed_weight, self.bias)


class TiledCPULinear(FlatLinear):
    """An fp32 linear through our C++ product (kernels/native/cpu_gemv.float_gemv) over its weight in tiles."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features = weight.shape[0]
        self.tiles = cpu_gemv.pack_float(weight)
        self.bias = bias

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_gemv.float_gemv(x, self.tiles, self.bias)


def cpu_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
    """The fastest CPU layer for this weight: TiledCPULinear for fp32 where our kernels run (and K is a multiple of
    their block), else PackedCPULinear."""
    if weight.dtype == torch.float32 and weight.shape[1] % cpu_gemv.BLOCK == 0 and cpu_extension.available():
        return TiledCPULinear(weight, bias)
    return PackedCPULinear(weight, bias)


def replace_linears(module: nn.Module, make: Callable[[nn.Module], nn.Module], kind: type = nn.Linear) -> None:
    """Replace every module of type kind (nn.Linear unless told) under module, in place, with make(it)."""
    for name, child in module.named_children():
        if isinstance(child, kind):
            setattr(module, name, make(child))
        else:
            replace_linears(child, make, kind)


def pack_linears(module: nn.Module) -> None:
    """Every nn.Linear under module in its packed CPU form (cpu_linear)."""
    replace_linears(module, lambda linear: cpu_linear(linear.weight, linear.bias))
