"""The sum over ranks of a row-parallel layer's output, the residual add and the RMSNorm after it, in one Triton
launch (tensor parallelism on GPUs joined by NVLink, a few token rows: decode steps).

Each rank's buffer is symmetric memory (torch.distributed._symmetric_memory): every GPU can write every rank's
buffer directly. One program per row pushes its row of x into its own slot of that row in every rank's buffer,
then polls its own buffer until every rank's slot holds a value, sums them in rank order in fp32, adds the
residual and normalises as kernels/rms_norm.py does. No flag and no remote read: an empty slot holds -0.0's bits in
every element (a rank sends -0.0 as +0.0, which sums the same), so an element is there once its bits are not
-0.0's, whichever order the NVLink writes land in (the "Lamport" one-shot all-reduce).

The buffer holds three copies of every slot, used in turn by a row's calls: a rank can be at most one call ahead
of another (it waits for every rank's row at each call), so while a rank reads call c's copy the others write
call c's or call c + 1's, and it empties call c - 1's copy, which no rank writes before call c + 2.

Rounding: the sum is rounded to the model dtype once, as NCCL does for two ranks (so tp = 2 is bit-identical to
NCCL + the fused norm, -0.0 sums aside); with more ranks NCCL rounds after each partial sum, this only once. Every
rank adds in the same order, so all ranks get the same bits.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fasterllm.kernels.dependent_launch import early_launch, early_start

EMPTY = -0x8000  # -0.0's bits as an int16: an empty slot's value (the buffer holds 16-bit floats)
COPIES = 3
_EMPTY, _COPIES = tl.constexpr(EMPTY), tl.constexpr(COPIES)


@triton.jit
def _all_reduce_add_rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, y_ptr, new_residual_ptr, buffers_ptr,
                                    epochs_ptr, eps, HIDDEN: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
                                    RANK: tl.constexpr, WORLD: tl.constexpr, PDL: tl.constexpr):
    early_start(PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    offsets = row.to(tl.int64) * HIDDEN + cols
    epoch = tl.load(epochs_ptr + row) + 1  # this row's calls so far, the same count on every rank
    tl.store(epochs_ptr + row, epoch)
    copy_size: tl.constexpr = WORLD * ROWS * HIDDEN
    this_copy = (epoch % _COPIES).to(tl.int64) * copy_size
    last_copy = ((epoch + _COPIES - 1) % _COPIES).to(tl.int64) * copy_size
    bits = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.int16, bitcast=True)
    bits = tl.where(bits == _EMPTY, 0, bits).to(tl.int16)
    slot = (RANK * ROWS + row).to(tl.int64) * HIDDEN + cols
    for rank in tl.static_range(WORLD):
        peer = tl.load(buffers_ptr + rank).to(tl.pointer_type(tl.int16))
        tl.store(peer + this_copy + slot, bits, mask=mask)
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
    summed = total.to(dtype).to(tl.float32)  # the all-reduced row, in the model dtype, as NCCL gives it
    x = (summed + tl.load(residual_ptr + offsets, mask=mask, other=0.0).to(tl.float32)).to(dtype)
    tl.store(new_residual_ptr + offsets, x, mask=mask)
    x = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / HIDDEN + eps)
    normed = (x * rstd).to(dtype).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offsets, (normed * weight).to(dtype), mask=mask)


def all_reduce_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                            buffers: torch.Tensor, epochs: torch.Tensor, rank: int, world: int
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(sum over ranks of x + residual) * weight, that sum + residual) for contiguous 16-bit x, residual
    [T, H]. buffers: an int64 device tensor of every rank's symmetric buffer address, in rank order, each buffer
    COPIES x world x R x H int16 filled with EMPTY at first; epochs: this rank's R int32 call counts (zero at
    first). T <= R; every rank calls it with the same T, in the same order."""
    num_tokens, hidden = x.shape
    y, new_residual = torch.empty_like(x), torch.empty_like(x)
    if num_tokens:
        block = triton.next_power_of_2(hidden)
        _all_reduce_add_rms_norm_kernel[(num_tokens,)](
            x, residual, weight, y, new_residual, buffers, epochs, eps, HIDDEN=hidden, BLOCK=block,
            ROWS=epochs.shape[0], RANK=rank, WORLD=world, num_warps=4 if block <= 1024 else 8,
            **early_launch(x.device))
    return y, new_residual
