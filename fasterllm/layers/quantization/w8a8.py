"""W8A8 (FasterLLaMA): INT8 weights per output channel and INT8 activations per token, quantized
dynamically each forward, multiplied in int32 and scaled back to the activation dtype.

On the CPU the int8 x int8 -> int32 product is torch._int_mm (it runs on the CPU in torch 2.11 and
2.13), given the [N, K] weight as its transposed view: oneDNN reads that layout 2.4x faster than a contiguous
[K, N] copy (one row, AVX-512; benchmarks/RESULTS.md, "CPUs without AVX-512"). Where _int_mm's sums are not exact
(no VNNI: cpu_features.exact_int8_matmul) the codes are kept as fp32 and multiplied by an fp32 linear instead: its
sums of integer products are the same integers (exact below 2^24), at an fp32 linear's speed.
"""
from __future__ import annotations

import torch

from fasterllm.cpu_features import cpu_features
from fasterllm.layers.linear import FlatLinear, PackedCPULinear, can_pack
from fasterllm.layers.quantization.int8 import quantize_int8_per_channel


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (int8 [M, K], fp32 scales [M, 1]) with x ~= int8 * scale (symmetric, absmax / 127)."""
    scales = x.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127.0
    return torch.round(x.float() / scales).clamp(-127, 127).to(torch.int8), scales


class W8A8Linear(FlatLinear):
    """Built from int8 codes [N, K] and fp32 scales [N] (a checkpoint's, as stored); from_float quantizes."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features = qweight.shape[0]
        self.qweight = qweight if cpu_features().exact_int8_matmul else None
        self.float_codes = None if self.qweight is not None else _float_linear(qweight.float())
        self.weight_scales = scales.float()[None, :]
        self.bias = bias

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> W8A8Linear:
        return cls(*quantize_int8_per_channel(weight), bias)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        qx, x_scales = quantize_per_token(x)
        sums = torch._int_mm(qx, self.qweight.t()) if self.qweight is not None else self.float_codes(qx.float())
        out = (sums * x_scales * self.weight_scales).to(x.dtype)
        return out if self.bias is None else out + self.bias


def _float_linear(weight: torch.Tensor) -> torch.nn.Module:
    """The int8 codes [N, K] held as fp32 in a linear without bias: oneDNN-packed wherever oneDNN is built in."""
    if can_pack(weight.device, weight.dtype):
        return PackedCPULinear(weight, None)
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight = torch.nn.Parameter(weight, requires_grad=False)
    return linear
