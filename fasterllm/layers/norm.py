"""RMSNorm, optionally adding the residual first (the add is fused into the norm's call)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (normed, new residual); the residual stream is the sum before the norm."""
        if residual is not None:
            x = x + residual
        # one fused call; it accumulates in fp32 for bf16/fp16 inputs
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps), x
