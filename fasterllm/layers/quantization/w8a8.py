"""W8A8 (FasterLLaMA): INT8 weights per output channel and INT8 activations per token, quantized
dynamically each forward, multiplied in int32 and scaled back to the activation dtype.

On the CPU the int8 x int8 -> int32 product is torch._int_mm (it runs on the CPU in torch 2.11 and
2.13); the weight is stored transposed once ([K, N]) because _int_mm takes the right operand as is.
"""
from __future__ import annotations

import torch

from fasterllm.layers.linear import FlatLinear
from fasterllm.layers.quantization.int8 import quantize_int8_per_channel


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (int8 [M, K], fp32 scales [M, 1]) with x ~= int8 * scale (symmetric, absmax / 127)."""
    scales = x.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127.0
    return torch.round(x.float() / scales).clamp(-127, 127).to(torch.int8), scales


class W8A8Linear(FlatLinear):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features = weight.shape[0]
        qweight, scales = quantize_int8_per_channel(weight)
        self.qweight_t = qweight.t().contiguous()
        self.weight_scales = scales[None, :]
        self.bias = bias

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        qx, x_scales = quantize_per_token(x)
        out = (torch._int_mm(qx, self.qweight_t) * x_scales * self.weight_scales).to(x.dtype)
        return out if self.bias is None else out + self.bias
