"""Random weights of a checkpoint's shape, for benchmarks: timing does not depend on the values."""
from __future__ import annotations

import torch
from torch import nn

SPREAD = 0.02  # transformers' initialisation: N(0, 0.02)


@torch.no_grad()
def fill_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Norm scales 1, every other float parameter N(0, SPREAD), drawn on the model's device; then a pre-quantized
    checkpoint's held codes (layers/quantization/stored.py: the modules with fill_random) random codes with scales of
    that spread (their biases stay the float draw)."""
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif param.dtype.is_floating_point and param.element_size() > 1:  # not codes (integers, e4m3)
            param.normal_(0.0, SPREAD, generator=generator)
    for module in model.modules():
        if hasattr(module, "fill_random"):
            module.fill_random(generator, SPREAD)
