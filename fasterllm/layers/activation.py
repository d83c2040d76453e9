"""act(gate) * up over the fused gate_up projection's output [T, 2I] -> [T, I]: SiLU (Llama), GELU (Gemma 2)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if gate_up.is_cuda:  # one Triton launch instead of three elementwise passes
        from fasterllm.kernels.activation import silu_and_mul as silu_and_mul_kernel

        return silu_and_mul_kernel(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    """silu_and_mul as a module of the decoder layer, so a quantized model can swap in a version that writes
    the down projection's quantized input (layers/quantization/fused_activation.py)."""

    name = "silu"  # as kernels/fused_moe.py names it

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(gate_up)


class GeluAndMul(nn.Module):
    """GELU(gate) * up (Gemma 2's GeGLU); approximate: 'tanh' or 'none', as F.gelu takes it."""

    def __init__(self, approximate: str):
        super().__init__()
        self.approximate = approximate
        self.name = "gelu_tanh" if approximate == "tanh" else "gelu"  # as kernels/fused_moe.py names it

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate=self.approximate) * up
