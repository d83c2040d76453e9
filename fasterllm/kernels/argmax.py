"""Each row's argmax (greedy sampling) over a wide vocabulary (Triton): the same index torch.argmax gives.

torch's argmax reduces a row with one block of threads: over Llama-3's 128,256 logits a batch-1 step spent 29 us in
it on an H100, the longest kernel outside the decoder layers (benchmarks/RESULTS.md). Here the row is split into
chunks, one program each, in two launches: each chunk's first largest value and its index, then each row's first
largest chunk. Ties go to the smallest index and a NaN wins over every number (the first NaN), as in torch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fasterllm.kernels.dependent_launch import early_launch, early_start

_CHUNK = 4096


@triton.jit
def _chunk_argmax_kernel(x_ptr, values_ptr, indices_ptr, stride_x, WIDTH, CHUNKS: tl.constexpr,
                         BLOCK: tl.constexpr, PDL: tl.constexpr):
    early_start(PDL)
    row, chunk = tl.program_id(0).to(tl.int64), tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride_x + cols, mask=cols < WIDTH, other=float("-inf")).to(tl.float32)
    first_nan = tl.min(tl.where(x != x, cols, WIDTH), axis=0)
    x = tl.where(x != x, float("-inf"), x)  # NaNs apart: tl.argmax's NaN order differs between GPU and interpreter
    best = tl.argmax(x, axis=0, tie_break_left=True)
    value = tl.max(x, axis=0)
    index = tl.where(first_nan < WIDTH, first_nan, chunk * BLOCK + best)
    value = tl.where(first_nan < WIDTH, float("nan"), value)
    tl.store(values_ptr + row * CHUNKS + chunk, value)
    tl.store(indices_ptr + row * CHUNKS + chunk, index)


@triton.jit
def _row_argmax_kernel(values_ptr, indices_ptr, out_ptr, CHUNKS: tl.constexpr, BLOCK: tl.constexpr,
                       PDL: tl.constexpr):
    early_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunks = tl.arange(0, BLOCK)
    mask = chunks < CHUNKS
    values = tl.load(values_ptr + row * CHUNKS + chunks, mask=mask, other=float("-inf"))
    indices = tl.load(indices_ptr + row * CHUNKS + chunks, mask=mask, other=0)
    nan_chunk = tl.min(tl.where(values != values, chunks, BLOCK), axis=0)  # chunks are in index order
    numbers = tl.where(values != values, float("-inf"), values)
    best = tl.where(nan_chunk < BLOCK, nan_chunk, tl.argmax(numbers, axis=0, tie_break_left=True))
    tl.store(out_ptr + row, tl.sum(tl.where(chunks == best, indices, 0), axis=0))


def fits(x: torch.Tensor) -> bool:
    """Whether argmax_rows reads x: 2-D, last dim contiguous, a float it compares exactly in fp32 (not float64)."""
    return x.dim() == 2 and x.stride(-1) == 1 and x.dtype in (torch.float32, torch.bfloat16, torch.float16)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x [S, V] (float, last dim contiguous) -> [S] int64, the index of each row's largest value."""
    if not fits(x):
        raise ValueError(f"argmax_rows takes a 16- or 32-bit float [rows, width] tensor with a contiguous last dim, "
                         f"got {x.dtype} {tuple(x.shape)} with strides {x.stride()}")
    rows, width = x.shape
    if width == 0:
        return torch.argmax(x, dim=-1)  # torch's own error: an empty row has no largest value
    chunks = triton.cdiv(width, _CHUNK)
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows == 0:
        return out
    values = torch.empty(rows, chunks, dtype=torch.float32, device=x.device)
    indices = torch.empty(rows, chunks, dtype=torch.int64, device=x.device)
    launch = early_launch(x.device)
    _chunk_argmax_kernel[(rows, chunks)](x, values, indices, x.stride(0), width, CHUNKS=chunks, BLOCK=_CHUNK,
                                         num_warps=8, **launch)
    _row_argmax_kernel[(rows,)](values, indices, out, CHUNKS=chunks, BLOCK=triton.next_power_of_2(chunks),
                                num_warps=1, **launch)
    return out
