"""Float (bf16 / fp16 / fp32) linear layers on an NVIDIA GPU: one row through our matrix-vector kernel, more rows
through cuBLAS.

Batch-1 decode multiplies one row by every weight: kernels/gemv.py streams the weight without the tensor-core
tiling cuBLAS uses for it, 1.07-1.17x faster than cuBLAS at each Llama-3-8B projection on an H100
(benchmarks/RESULTS.md). Prefill and batched decode keep cuBLAS, the faster one there.

cuBLAS runs a Hopper kernel only where the output's rows are 16-byte aligned: an output width that is not a multiple
of 8 (BART's 50,265-token head, Marian's 58,101) fell to an sm75 kernel, 133 us for 64 rows of BART-large's head on an
H100. Such a weight gets zero rows up to a multiple of 64, in place (the layer's weight, and a tied embedding sharing
it, become a view of the first rows), and the product's extra columns are dropped.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fasterllm.kernels.gemv import gemv
from fasterllm.kernels.one_shot_all_reduce import RankBuffers
from fasterllm.layers.linear import FlatLinear, replace_linears


_ALIGNED_ROWS = 8  # outputs of 16 bytes (bf16 / fp16)
_PADDED_ROWS = 64


class GPULinear(FlatLinear):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features = weight.shape[0]
        self.padded_weight, self.padded_bias = _padded_rows(weight), None
        if self.padded_weight is not None:
            weight.data = self.padded_weight[:self.out_features]  # one copy in memory, shared with a tied embedding
            if bias is not None:
                self.padded_bias = bias.new_zeros(self.padded_weight.shape[0])
                self.padded_bias[:self.out_features] = bias
        self.weight, self.bias = weight, bias

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.padded_weight is not None and x.shape[0] > 1:
            return F.linear(x, self.padded_weight, self.padded_bias)[:, :self.out_features]
        return float_linear(x, self.weight, self.bias)

    def push_row(self, x: torch.Tensor, push_to: RankBuffers) -> None:
        """One row's product, a row-parallel layer's partial sums, written straight into the fused all-reduce's
        buffers (distributed/symmetric_all_reduce.py) instead of to an output."""
        gemv(x, self.weight, bias=self.bias, push_to=push_to)


def float_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (contiguous) @ weight^T (+ bias) on a GPU: one row through our matrix-vector kernel, more through
    cuBLAS. For float weights outside a GPULinear too (a mixture of experts' router, which quantization keeps
    float)."""
    return gemv(x, weight, bias=bias) if x.shape[0] == 1 else F.linear(x, weight, bias)


def _padded_rows(weight: torch.Tensor) -> torch.Tensor | None:
    """weight [N, K] with zero rows up to a multiple of 64, where N is not a multiple of 8; else None."""
    rows = weight.shape[0]
    if rows % _ALIGNED_ROWS == 0:
        return None
    padded = weight.new_zeros(-(-rows // _PADDED_ROWS) * _PADDED_ROWS, weight.shape[1])
    padded[:rows] = weight
    return padded


def use_gemv_linears(module: nn.Module) -> None:
    """Every nn.Linear under module (in place) as a GPULinear over the same weight."""
    replace_linears(module, lambda linear: GPULinear(linear.weight, linear.bias))
