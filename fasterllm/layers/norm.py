"""RMSNorm, optionally adding the residual first (the add is fused into the norm's call)."""
from __future__ import annotations

import torch
from torch import nn

from fasterllm.kernels.native import cpu_rms_norm


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (normed, new residual); the residual stream is the sum before the norm."""
        if x.is_cuda:  # one Triton launch, same rounding as below
            from fasterllm.kernels.rms_norm import fused_add_rms_norm, rms_norm

            if residual is None:
                return rms_norm(x, self.weight, self.eps), x
            return fused_add_rms_norm(x, residual, self.weight, self.eps)
        if cpu_rms_norm.runs(x, self.weight):  # one C++ call (native/cpu_rms_norm.py)
            return cpu_rms_norm.add_rms_norm(x, residual, self.weight, self.eps)
        if residual is not None:
            x = x + residual
        # normalise in fp32 and round once before the weight, as the reference models do: a norm computed in bf16
        # changes SmolLM2's answers (one decode step calls this 61 times)
        if _fused_fp32_rms_norm is not None:  # widens to fp32 and rounds back itself: bit-equal to the lines below
            return _fused_fp32_rms_norm(x, [x.shape[-1]], None, self.eps)[0].mul_(self.weight), x
        x32 = x.float()
        normed = x32 * x32.square().mean(-1, keepdim=True).add_(self.eps).rsqrt_()
        return normed.to(x.dtype).mul_(self.weight), x


# torch's RMSNorm op (not in every torch build): on the CPU a composite of the same small ops, but one Python call
# where the written-out form makes five, and 0.8 us faster than F.rms_norm, which calls it
_fused_fp32_rms_norm = getattr(torch, "_fused_rms_norm", None)


def norm_add_norm(x: torch.Tensor, residual: torch.Tensor, first: nn.Module, second: nn.Module
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sandwich norms (Gemma 2 / 3): second(first(x) + residual), returning second's (normed, new residual). On a GPU,
    with both plain RMSNorms, one launch (kernels/rms_norm.py), rounded as the two calls round."""
    if x.is_cuda and type(first) is RMSNorm and type(second) is RMSNorm:
        from fasterllm.kernels.rms_norm import norm_add_rms_norm

        return norm_add_rms_norm(x, residual, first.weight, first.eps, second.weight, second.eps)
    return second(first(x)[0], residual)
