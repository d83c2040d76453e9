"""The sum over ranks of a row-parallel layer's output, the residual add and the RMSNorm after it, in one Triton
launch (tensor parallelism on GPUs joined by NVLink, a few token rows: decode steps).

Each rank's buffer is symmetric memory (torch.distributed._symmetric_memory): every GPU can write every rank's
buffer directly. One program per row pushes its row of x into its own slot of that row in every rank's buffer,
then polls its own buffer until every rank's slot holds a value, sums them in rank order in fp32, adds the
residual and normalises as kernels/rms_norm.py does. No flag and no remote read: an empty slot holds -0.0's bits in
every element (a rank sends -0.0 as +0.0, which sums the same), so an element is there once its bits are not
-0.0's, whichever order the NVLink writes land in (the "Lamport" one-shot all-reduce). A one-row product whose
output is the all-reduce's input can push its row itself, from its epilogue (push_for_next_call; kernels/gemv.py's
push_to): its row
travels while it finishes, and the all-reduce's launch only polls, sums and normalises (x None).

The buffer holds three copies of every slot, used in turn by a row's calls: a rank can be at most one call ahead
of another (it waits for every rank's row at each call), so while a rank reads call c's copy the others write
call c's or call c + 1's, and it empties call c - 1's copy, which no rank writes before call c + 2.

Rounding: the sum is rounded to the model dtype once, as NCCL does for two ranks (so tp = 2 is bit-identical to
NCCL + the fused norm, -0.0 sums aside); with more ranks NCCL rounds after each partial sum, this only once. Every
rank adds in the same order, so all ranks get the same bits.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fasterllm.kernels.dependent_launch import early_launch, early_start

EMPTY = -0x8000  # -0.0's bits as an int16: an empty slot's value (the buffer holds 16-bit floats)
COPIES = 3
_EMPTY, _COPIES = tl.constexpr(EMPTY), tl.constexpr(COPIES)


@dataclass(frozen=True)
class RankBuffers:
    """What push_to_every_rank writes to: every rank's buffer address (an int64 device tensor, rank order), this
    rank's call count per row slot modulo COPIES (int32 device tensor), this rank and the number of ranks."""
    buffers: torch.Tensor
    epochs: torch.Tensor
    rank: int
    world: int


@triton.jit
def copy_offset(epoch, copy_size):
    """Where call `epoch` of a row (its epochs entry + 1, modulo COPIES or not) reads and writes in a buffer: its
    copy's first element."""
    return (epoch % _COPIES).to(tl.int64) * copy_size


@triton.jit
def push_to_every_rank(values, cols, mask, buffers_ptr, this_copy, row, HIDDEN, ROWS: tl.constexpr,
                       RANK: tl.constexpr, WORLD: tl.constexpr):
    """Write this rank's part of row `row` (values at columns cols, 16-bit floats) into its slot of the copy at
    this_copy (copy_offset of the row's call) in every rank's buffer, a -0.0 as +0.0 (an empty slot is -0.0)."""
    bits = values.to(tl.int16, bitcast=True)
    bits = tl.where(bits == _EMPTY, 0, bits).to(tl.int16)
    slot = tl.cast(RANK * ROWS + row, tl.int64) * HIDDEN + cols
    for rank in tl.static_range(WORLD):
        peer = tl.load(buffers_ptr + rank).to(tl.pointer_type(tl.int16))
        tl.store(peer + this_copy + slot, bits, mask=mask)


@triton.jit
def push_for_next_call(values, cols, mask, buffers_ptr, epochs_ptr, row, HIDDEN, ROWS: tl.constexpr,
                       RANK: tl.constexpr, WORLD: tl.constexpr):
    """push_to_every_rank for the row's call about to be made (its epochs entry + 1: only the all-reduce's launch
    counts it). A matrix product whose output is this all-reduce's input calls it in its epilogue (kernels/gemv.py),
    so the row travels while the product finishes."""
    next_call = copy_offset(tl.load(epochs_ptr + row) + 1, WORLD * ROWS * HIDDEN)
    push_to_every_rank(values, cols, mask, buffers_ptr, next_call, row, HIDDEN, ROWS, RANK, WORLD)


@triton.jit
def _all_reduce_add_rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, y_ptr, new_residual_ptr, buffers_ptr,
                                    epochs_ptr, eps, HIDDEN: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
                                    RANK: tl.constexpr, WORLD: tl.constexpr, PUSHED: tl.constexpr,
                                    HAS_RESIDUAL: tl.constexpr, PDL: tl.constexpr):
    early_start(PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    offsets = row.to(tl.int64) * HIDDEN + cols
    epoch = tl.load(epochs_ptr + row) + 1  # this row's calls so far, the same count on every rank
    copy_size: tl.constexpr = WORLD * ROWS * HIDDEN
    this_copy = copy_offset(epoch, copy_size)
    last_copy = copy_offset(epoch + _COPIES - 1, copy_size)
    if not PUSHED:  # else the product before this launch pushed this rank's row already
        push_to_every_rank(tl.load(x_ptr + offsets, mask=mask, other=0.0), cols, mask, buffers_ptr, this_copy, row,
                           HIDDEN, ROWS, RANK, WORLD)
    # every warp has read the count before one stores the next: a warp that read it late would poll another copy
    tl.debug_barrier()
    tl.store(epochs_ptr + row, epoch % _COPIES)  # only the copy counts: an int32 count would wrap within days
    own = tl.load(buffers_ptr + RANK).to(tl.pointer_type(tl.int16))
    ranks = tl.arange(0, WORLD)
    slots = (ranks[:, None] * ROWS + row).to(tl.int64) * HIDDEN + cols[None, :]  # [WORLD, BLOCK]
    slot_mask = (ranks[:, None] < WORLD) & mask[None, :]
    rows = tl.load(own + this_copy + slots, mask=slot_mask, other=0, volatile=True)
    while tl.max(tl.max((rows == _EMPTY).to(tl.int32), axis=1), axis=0) > 0:
        rows = tl.load(own + this_copy + slots, mask=slot_mask, other=0, volatile=True)
    tl.store(own + last_copy + slots, tl.full([WORLD, BLOCK], _EMPTY, tl.int16), mask=slot_mask)
    dtype = y_ptr.dtype.element_ty
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for rank in tl.static_range(WORLD):  # in rank order, the same on every rank
        total += tl.sum(tl.where(ranks[:, None] == rank, rows.to(dtype, bitcast=True).to(tl.float32), 0.0), axis=0)
    x = total.to(dtype)  # the all-reduced row, in the model dtype, as NCCL gives it
    if HAS_RESIDUAL:
        x = (x.to(tl.float32) + tl.load(residual_ptr + offsets, mask=mask, other=0.0).to(tl.float32)).to(dtype)
    tl.store(new_residual_ptr + offsets, x, mask=mask)
    x = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / HIDDEN + eps)
    normed = (x * rstd).to(dtype).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offsets, (normed * weight).to(dtype), mask=mask)


def all_reduce_add_rms_norm(x: torch.Tensor | None, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                            ranks: RankBuffers) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(sum over ranks of x + residual) * weight, that sum + residual) for contiguous 16-bit x, residual
    [T, H]. ranks.buffers: every rank's symmetric buffer, each COPIES x world x R x H int16 filled with EMPTY at first;
    ranks.epochs: this rank's R call counts (zero at first). T <= R; every rank calls it with the same T, in the
    same order. x None: the launch before this one pushed this rank's rows already (push_for_next_call). residual
    None: nothing is added (the first layer's norm over the embedding's rows, summed over the vocabulary's ranks)."""
    if x is None and residual is None:
        raise ValueError("all_reduce_add_rms_norm needs x, residual or both: with neither the rows' shape is unknown")
    like = residual if residual is not None else x
    num_tokens, hidden = like.shape
    y, new_residual = torch.empty_like(like), torch.empty_like(like)
    if num_tokens:
        block = triton.next_power_of_2(hidden)
        _all_reduce_add_rms_norm_kernel[(num_tokens,)](
            like if x is None else x, like, weight, y, new_residual, ranks.buffers, ranks.epochs, eps,
            HIDDEN=hidden, BLOCK=block, ROWS=ranks.epochs.shape[0], RANK=ranks.rank, WORLD=ranks.world,
            PUSHED=x is None, HAS_RESIDUAL=residual is not None,
            num_warps=4 if block <= 1024 else 8, **early_launch(like.device))
    return y, new_residual
