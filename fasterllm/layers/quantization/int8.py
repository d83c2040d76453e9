"""Weight-only INT8 linear layers (per output channel), quantized at load time.

Decode on the CPU streams every weight once per step, so weights of one byte instead of two are
read about twice as fast. Scales are symmetric per output row: absmax / 127. Two kernels, one chosen per layer at
load: our C++ one where it is built and K is a multiple of 32 (unless FASTERLLM_CPU_KERNELS=off)
(kernels/native/cpu_gemv.py: the codes repacked into its tiles and multiplied by the inputs as they come with fp32
FMAs), else torch's packed CPU kernel (`_weight_int8pack_mm`), which dequantizes inside the matrix product and takes bf16 activations
whatever the model's dtype: with fp32 ones it ran 8-15x slower, on AVX-512 and on AVX2 alike (benchmarks/RESULTS.md,
"CPUs without AVX-512").
"""
from __future__ import annotations

import torch

from fasterllm.kernels.native import cpu_extension, cpu_gemv
from fasterllm.layers.linear import FlatLinear

# the activation dtype of torch's packed int8 / int4 CPU kernels (their fast path on every CPU measured)
PACKED_KERNEL_DTYPE = torch.bfloat16


def quantize_int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (int8 [N, K], fp32 scales [N]) with weight ~= int8 * scale[:, None]."""
    w = weight.float()
    scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    return torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8), scales


class Int8WeightOnlyLinear(FlatLinear):
    """Built from int8 codes [N, K] and fp32 scales [N] (a checkpoint's, as stored); from_float quantizes.
    native: run our C++ kernel (None: where it is on, built, and K fits it); False keeps torch's."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                 native: bool | None = None):
        super().__init__()
        self.out_features = qweight.shape[0]
        fits = qweight.shape[1] % cpu_gemv.BLOCK == 0
        self.native = cpu_gemv.pack_int8(qweight, scales) if fits and (
            cpu_extension.available() if native is None else native) else None
        if self.native is None:
            self.qweight = qweight.contiguous()
            self.scales = scales.to(PACKED_KERNEL_DTYPE)
        self.bias = bias

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> Int8WeightOnlyLinear:
        return cls(*quantize_int8_per_channel(weight), bias)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None:
            out = cpu_gemv.int8_gemv(x, self.native)  # in x's dtype
        else:
            out = torch._weight_int8pack_mm(x.to(PACKED_KERNEL_DTYPE), self.qweight, self.scales).to(x.dtype)
        return out if self.bias is None else out + self.bias
