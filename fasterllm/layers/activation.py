"""act(gate) * up over the fused gate_up projection's output [T, 2I] -> [T, I]: SiLU (Llama), GELU (Gemma 2, T5
v1.1), ReLU (T5's gated-relu)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

TORCH_ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda g: F.gelu(g, approximate="tanh"), "gelu": F.gelu,
                     "relu": F.relu}


def act_and_mul(gate_up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """activation (a TORCH_ACTIVATIONS name) of the first half times the second half."""
    if gate_up.is_cuda:  # one Triton launch instead of two or three elementwise passes
        from fasterllm.kernels.activation import act_and_mul as act_and_mul_kernel

        return act_and_mul_kernel(gate_up, activation)
    gate, up = gate_up.chunk(2, dim=-1)
    return TORCH_ACTIVATIONS[activation](gate) * up


class SiluAndMul(nn.Module):
    """act_and_mul with SiLU as a module of the decoder layer, so a quantized model can swap in a version that writes
    the down projection's quantized input (layers/quantization/fused_activation.py)."""

    name = "silu"  # as kernels/fused_moe.py names it

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return act_and_mul(gate_up)


class GeluAndMul(nn.Module):
    """GELU(gate) * up (Gemma 2's GeGLU); approximate: 'tanh' or 'none', as F.gelu takes it."""

    def __init__(self, approximate: str):
        super().__init__()
        self.name = "gelu_tanh" if approximate == "tanh" else "gelu"  # as kernels/fused_moe.py names it

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return act_and_mul(gate_up, self.name)
