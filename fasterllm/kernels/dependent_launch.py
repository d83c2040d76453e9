"""Programmatic dependent launch (PDL, NVIDIA compute capability 9.0 and later) for the kernels of a decode step.

A batch-1 decode step is a chain of a few hundred kernels, each reading what the one before wrote. Launched the
usual way, a kernel's programs are placed on the GPU only once the previous kernel has finished and flushed its
writes. Launched with PDL (`launch_pdl=True`), they may be placed as soon as every program of the previous kernel
has passed `griddepcontrol.launch_dependents`, so their launch overlaps its last programs, and
`griddepcontrol.wait` then holds them until the previous kernel has finished and its writes are visible. On an
H100 this took 2% off the 8B shape's batch-1 step and 19% off BART-large's, whose step is many small launches
(benchmarks/RESULTS.md).

A kernel launched with `**early_launch(device)` calls early_start(PDL) before it reads or writes anything another
kernel touches: it waits for the previous kernel, then lets the next one start. Only a layer's weights, which no
kernel writes while decode steps run, may be read before it, through a load_weight_chunk (the first chunk of gemv.py's
float weights, the first step's of int4_gemv.py and int8_gemv.py; tests/kernels/test_dependent_launch.py checks the
sources; the Gluon kernels wait through gluon_parts.early_start). A kernel that was not
launched with PDL, or whose previous kernel never signals (cuBLAS, torch's own), passes both instructions at once.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from fasterllm.kernels.triton_target import interpreting


def early_launch(device: torch.device) -> dict[str, bool]:
    """The keywords a decode kernel's launch on this device takes: the kernel's PDL (its early_start) and Triton's
    launch_pdl, both True on a CUDA GPU of compute capability 9.0 or later (not Triton's CPU interpreter)."""
    early = device.type == "cuda" and _pdl_capable(device.index)
    return {"PDL": early, "launch_pdl": early}


@functools.cache
def _pdl_capable(index: int | None) -> bool:
    return not interpreting() and torch.cuda.get_device_capability(index)[0] >= 9


@triton.jit
def early_start(PDL: tl.constexpr):
    """Wait for the previous kernel (all its writes visible), then let the next kernel's programs start."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
