"""A decode batch's inputs moved on by one token in one launch (Triton): each row's position and length one more, its
slot looked up in its block table, and (where the step's inputs are the previous step's samples, still on the
device) its input id taken from them. Staged from torch this is about ten launches, each costing the host more than
the GPU; a host-bound decode step (a small model, or many short requests) pays for every one (worker/input_buffers.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 256


@triton.jit(do_not_specialize=["num_rows"])  # any row count, one compiled variant
def _advance_decode_kernel(positions_ptr, seq_lens_ptr, slots_ptr, tables_ptr, input_ids_ptr, samples_ptr,
                           num_rows, table_stride, block_size, HAS_SAMPLES: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = rows < num_rows
    position = tl.load(positions_ptr + rows, mask=mask) + 1
    tl.store(positions_ptr + rows, position, mask=mask)
    tl.store(seq_lens_ptr + rows, tl.load(seq_lens_ptr + rows, mask=mask) + 1, mask=mask)
    block = tl.load(tables_ptr + rows.to(tl.int64) * table_stride + position // block_size, mask=mask)
    tl.store(slots_ptr + rows, block.to(tl.int64) * block_size + position % block_size, mask=mask)
    if HAS_SAMPLES:
        tl.store(input_ids_ptr + rows, tl.load(samples_ptr + rows, mask=mask), mask=mask)


def advance_decode_inputs(positions: torch.Tensor, seq_lens: torch.Tensor, slot_mapping: torch.Tensor,
                          block_tables: torch.Tensor, block_size: int, num_rows: int,
                          input_ids: torch.Tensor | None = None, samples: torch.Tensor | None = None) -> None:
    """In place, for the first num_rows rows: positions and seq_lens one more, slot_mapping the new position's slot
    (block_tables [rows, width] int32, row-major), and input_ids the samples' ids where samples is given (int64)."""
    if (input_ids is None) != (samples is None):
        raise ValueError("advance_decode_inputs takes input_ids and samples together (the samples become the ids)")
    if num_rows == 0:
        return
    if block_tables.stride(1) != 1:
        raise ValueError(f"block_tables must be row-major (stride 1 along a row), got strides {block_tables.stride()}")
    has_samples = samples is not None
    _advance_decode_kernel[(triton.cdiv(num_rows, _BLOCK),)](
        positions, seq_lens, slot_mapping, block_tables, input_ids if has_samples else positions,
        samples if has_samples else positions, num_rows, block_tables.stride(0), block_size,
        HAS_SAMPLES=has_samples, BLOCK=_BLOCK)
