"""SiLU-and-mul for the LLaMA MLP (Triton): [gate | up] -> silu(gate) * up in one pass over memory.

Rounding follows the reference, `F.silu(gate) * up` in models/llama.py: silu in fp32 rounded to the dtype,
then the product in fp32 rounded once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fasterllm.kernels.dependent_launch import early_launch, early_start

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, y_ptr, stride_x, stride_y, WIDTH: tl.constexpr, BLOCK: tl.constexpr,
                         PDL: tl.constexpr):
    early_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < WIDTH
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + WIDTH + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, (silu * up.to(tl.float32)).to(gate.dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] = [gate | up] -> silu(gate) * up, [T, I] in x's dtype."""
    if x.dim() != 2 or x.shape[1] % 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be [T, 2 * intermediate] with a contiguous last dim, got {tuple(x.shape)} "
                         f"with strides {x.stride()}")
    num_tokens, width = x.shape[0], x.shape[1] // 2
    y = torch.empty(num_tokens, width, dtype=x.dtype, device=x.device)
    if num_tokens:
        _silu_and_mul_kernel[(num_tokens, triton.cdiv(width, _BLOCK))](
            x, y, x.stride(0), y.stride(0), WIDTH=width, BLOCK=_BLOCK, **early_launch(x.device))
    return y
