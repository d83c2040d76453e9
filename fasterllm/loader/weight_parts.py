"""Reading part of a checkpoint tensor: a tensor already in memory, or a safetensors slice that reads from the file
only the rows or columns asked for (a tensor-parallel rank reads its shard, not the whole tensor)."""
from __future__ import annotations

from typing import Any, Union

import torch

# a torch.Tensor, or safetensors' lazy slice (get_shape(); indexing reads the indexed part)
WeightSource = Union[torch.Tensor, Any]


def shape_of(source: WeightSource) -> tuple[int, ...]:
    return tuple(source.shape) if isinstance(source, torch.Tensor) else tuple(source.get_shape())


def read_whole(source: WeightSource) -> torch.Tensor:
    return source if isinstance(source, torch.Tensor) else source[:]


def read_part(source: WeightSource, dim: int, start: int, size: int) -> torch.Tensor:
    """Indices [start, start + size) along dim."""
    if isinstance(source, torch.Tensor):
        return source.narrow(dim, start, size)
    return source[(slice(None),) * dim + (slice(start, start + size),)]
