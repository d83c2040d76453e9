"""Random weights of a checkpoint's shape, for benchmarks: timing does not depend on the values."""
from __future__ import annotations

import torch
from torch import nn

SPREAD = 0.02  # transformers' initialisation: N(0, 0.02)


@torch.no_grad()
def fill_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Norm scales 1, everything else N(0, SPREAD), drawn on the model's device; a pre-quantized checkpoint's held
    codes (layers/quantization/stored.py: modules with fill_random) random codes with scales of that spread."""
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    held = set()
    for module in model.modules():
        if hasattr(module, "fill_random"):
            module.fill_random(generator, SPREAD)
            held.update(id(param) for param in module.parameters(recurse=False))
    for name, param in model.named_parameters():
        if id(param) in held:
            continue
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        else:
            param.normal_(0.0, SPREAD, generator=generator)
