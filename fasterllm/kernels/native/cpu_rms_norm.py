"""RMSNorm with the residual added first, in one C++ call (cpu/rms_norm.cpp, built by cpu_extension.py) where the
torch path makes several small ops: a decode step calls it twice per layer, 61 times for SmolLM2, and each torch op
costs about a microsecond whatever its size (benchmarks/RESULTS.md, issue 27). The same arithmetic as
layers/norm.py's torch path: the sum rounded to the model's dtype, normalised in fp32, rounded, times the weight.

bf16 and fp32: its sum of squares adds in another order than torch's, which moves an fp32 result by an ulp or so (the
models' products, oneDNN's or ours, are not bit-equal to transformers' either); in bf16 such a difference shows only
when it crosses a bf16 rounding boundary (at most one bf16 ulp, rarely; tests/layers/test_rms_norm_cpu.py)."""
from __future__ import annotations

import torch

from fasterllm.kernels.native import cpu_extension


def runs(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether layers/norm.py hands these tensors to add_rms_norm: bf16 or fp32, the extension built."""
    return x.dtype in (torch.bfloat16, torch.float32) and weight.dtype == x.dtype and cpu_extension.available()


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual) * weight, x + residual); x itself as the sum where residual is None."""
    if x.dim() == 2 and x.is_contiguous() and (residual is None or residual.is_contiguous()):
        # the decoder's flat rows already (a decode step calls this twice a layer): no reshapes around the call
        normed, summed = torch.ops.fasterllm_cpu.add_rms_norm(x, residual, weight, eps)
        return normed, (x if residual is None else summed)
    shape = x.shape
    flat = x.reshape(-1, shape[-1]).contiguous()
    summands = None if residual is None else residual.reshape(-1, shape[-1]).contiguous()
    normed, summed = torch.ops.fasterllm_cpu.add_rms_norm(flat, summands, weight.contiguous(), eps)
    return normed.view(shape), (x if residual is None else summed.view(shape))
