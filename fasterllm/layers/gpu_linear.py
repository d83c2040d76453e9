"""Float (bf16 / fp16 / fp32) linear layers on an NVIDIA GPU: one row through our matrix-vector kernel, more rows
through cuBLAS.

Batch-1 decode multiplies one row by every weight: kernels/gemv.py streams the weight without the tensor-core
tiling cuBLAS uses for it, 1.07-1.17x faster than cuBLAS at each Llama-3-8B projection on an H100
(benchmarks/RESULTS.md). Prefill and batched decode keep cuBLAS, the faster one there.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fasterllm.kernels.gemv import gemv
from fasterllm.layers.linear import FlatLinear, replace_linears


class GPULinear(FlatLinear):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.weight, self.bias = weight, bias
        self.out_features = weight.shape[0]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return gemv(x, self.weight, bias=self.bias) if x.shape[0] == 1 else F.linear(x, self.weight, self.bias)


def use_gemv_linears(module: nn.Module) -> None:
    """Every nn.Linear under module (in place) as a GPULinear over the same weight."""
    replace_linears(module, lambda linear: GPULinear(linear.weight, linear.bias))
