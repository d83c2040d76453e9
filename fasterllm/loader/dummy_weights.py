"""Random weights of a checkpoint's shape, for benchmarks: timing does not depend on the values."""
from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def fill_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Norm scales 1, everything else N(0, 0.02) (transformers' initialisation), drawn on the model's device."""
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        else:
            param.normal_(0.0, 0.02, generator=generator)
