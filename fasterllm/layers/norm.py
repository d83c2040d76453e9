"""RMSNorm, optionally adding the residual first (the add is fused into the norm's call)."""
from __future__ import annotations

import torch
from torch import nn


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
        if residual is not None:
            x = x + residual
        # normalise in fp32 and round once before the weight, as the reference models do: the fused
        # bf16 call loses enough precision to change SmolLM2's answers. Written out rather than
        # F.rms_norm, whose CPU composite runs more small ops (one decode step calls this 61 times)
        x32 = x.float()
        inverse_rms = x32.square().mean(-1, keepdim=True).add_(self.eps).rsqrt_()
        return (x32 * inverse_rms).to(x.dtype).mul_(self.weight), x
