"""What Triton does with a kernel here: runs it in its CPU interpreter (TRITON_INTERPRET, how CI tests the kernels)
or compiles it for the GPU of its tensors. Kernels take a cheaper path where they are compiled (inline PTX on NVIDIA
GPUs, casts the interpreter rounds otherwise) and the plain one the interpreter runs."""
from __future__ import annotations

import os

import torch


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET on, in any of Triton's true spellings)
    rather than compiling them."""
    return os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on", "yes")


def compiled_for_gpu(x: torch.Tensor) -> bool:
    """Whether Triton compiles for x's device, a GPU, rather than interpreting: then its fp8 casts round to nearest,
    and inline PTX runs on NVIDIA GPUs."""
    return x.is_cuda and not interpreting()
