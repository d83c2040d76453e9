"""Checkpoint tensors into a model's parameters, for the model families whose load_weights maps names themselves
(BART, T5): a tensor goes to a parameter, or to one part of a fused projection's rows (q/k/v into qkv_proj, ...);
a wrong name or shape is an error naming the tensor, and completeness is checked at the end."""
from __future__ import annotations

import torch
from torch import nn


class CheckpointCopier:
    def __init__(self, model: nn.Module, architecture: str, parts: dict[str, int]):
        """parts: a fused projection's module name -> how many checkpoint tensors its rows hold, in equal shares."""
        self.params = dict(model.named_parameters())
        self.architecture, self.parts = architecture, parts
        self.loaded: set[str | tuple[str, int]] = set()

    def copy(self, hf_name: str, target: str, part: int | None, tensor: torch.Tensor) -> None:
        """The tensor into parameter `target`, or into the part-th share of its rows."""
        if target not in self.params:
            raise ValueError(f"checkpoint tensor {hf_name!r} does not belong to a {self.architecture} with this "
                             "config; the checkpoint and its config disagree")
        dest = self.params[target]
        if part is not None:
            rows = dest.shape[0] // self.parts[target.split(".")[-2]]
            dest = dest.narrow(0, part * rows, rows)
        if dest.shape != tensor.shape:
            raise ValueError(f"checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)} but the config implies "
                             f"{tuple(dest.shape)}; the checkpoint and its config disagree")
        dest.copy_(tensor)
        self.loaded.add(target if part is None else (target, part))

    def has(self, name: str) -> bool:
        """Whether parameter `name` was filled: whole, or every share of a fused projection."""
        count = self.parts.get(name.split(".")[-2])
        return name in self.loaded or (count is not None and all((name, p) in self.loaded for p in range(count)))

    def check_complete(self, optional: set[str]) -> None:
        missing = sorted(name for name in self.params if name not in optional and not self.has(name))
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}; the file is incomplete or "
                             "for another architecture")
