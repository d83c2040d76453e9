"""The sum over ranks of a row-parallel layer's output, the residual add and the RMSNorm after it, in one Triton
launch (tensor parallelism on GPUs joined by NVLink, a few token rows: decode steps).

Each rank's buffer is symmetric memory (torch.distributed._symmetric_memory): every GPU can read every rank's
buffer directly. One program per row: it copies its row of x into this rank's buffer, meets the same row's program
on every other rank (each writes the row's call count, its epoch, into a flag in every rank's signal pad and waits
for theirs in its own), sums the W rows in rank order in fp32, then adds the residual and normalises as
kernels/rms_norm.py does. Calls alternate between two halves of the buffer: a rank can be at most one call ahead
of another (it waits for every rank at each call), so it never overwrites a row another still reads, and no
second meeting is needed. NCCL's ring for such small messages spends most of its time in latency; this reads each
peer once.

Rounding: the sum is rounded to the model dtype once, as NCCL does for two ranks (so tp = 2 is bit-identical to
NCCL + the fused norm); with more ranks NCCL rounds after each partial sum, this only once. Every rank adds in the
same order, so all ranks get the same bits.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_release(addresses, values):
    """Each value to its address (another GPU's memory too), after this thread's earlier writes."""
    return tl.inline_asm_elementwise("st.release.sys.global.u32 [$1], $2; mov.u32 $0, 0;", "=r,l,r",
                                     [addresses, values], dtype=tl.uint32, is_pure=False, pack=1)


@triton.jit
def _load_acquire(addresses):
    return tl.inline_asm_elementwise("ld.acquire.sys.global.u32 $0, [$1];", "=r,l", [addresses], dtype=tl.uint32,
                                     is_pure=False, pack=1)


@triton.jit
def _meet(pads_ptr, slot, epoch, RANK: tl.constexpr, WORLD: tl.constexpr):
    """Meet the program of the same slot on every rank: write this call's epoch into this rank's flag in every
    rank's pad, then wait until every rank's flag in this rank's pad reached it. Every thread's writes before it
    are seen by the other ranks' threads after it (release / acquire at system scope, a block barrier each side).
    A faster rank may already have written the next epoch: flags are compared as `at least`."""
    tl.debug_barrier()
    ranks = tl.arange(0, WORLD)
    pads = tl.load(pads_ptr + ranks).to(tl.pointer_type(tl.uint32))
    _store_release(pads + slot * WORLD + RANK, tl.full([WORLD], 0, tl.uint32) + epoch)
    own = tl.load(pads_ptr + RANK).to(tl.pointer_type(tl.uint32)) + slot * WORLD + ranks
    arrived = 0
    while arrived == 0:
        behind = (_load_acquire(own) - epoch).to(tl.int32) < 0
        arrived = 1 - tl.max(behind.to(tl.int32), axis=0)
    tl.debug_barrier()


@triton.jit
def _all_reduce_add_rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, y_ptr, new_residual_ptr, buffers_ptr, pads_ptr,
                                    epochs_ptr, eps, HIDDEN: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
                                    RANK: tl.constexpr, WORLD: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    offsets = row.to(tl.int64) * HIDDEN + cols
    epoch = tl.load(epochs_ptr + row) + 1  # this row's calls so far, the same count on every rank
    tl.store(epochs_ptr + row, epoch)
    # two halves, alternating: a rank that is a call ahead writes the half no rank reads any more
    half = (epoch % 2).to(tl.int64) * ROWS * HIDDEN
    dtype = y_ptr.dtype.element_ty
    own = tl.load(buffers_ptr + RANK).to(tl.pointer_type(dtype)) + half
    tl.store(own + offsets, tl.load(x_ptr + offsets, mask=mask, other=0.0), mask=mask)
    _meet(pads_ptr, row, epoch.to(tl.uint32), RANK, WORLD)
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for rank in tl.static_range(WORLD):
        buffer = tl.load(buffers_ptr + rank).to(tl.pointer_type(dtype)) + half
        total += tl.load(buffer + offsets, mask=mask, other=0.0, volatile=True).to(tl.float32)
    summed = total.to(dtype).to(tl.float32)  # the all-reduced row, in the model dtype, as NCCL gives it
    x = (summed + tl.load(residual_ptr + offsets, mask=mask, other=0.0).to(tl.float32)).to(dtype)
    tl.store(new_residual_ptr + offsets, x, mask=mask)
    x = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / HIDDEN + eps)
    normed = (x * rstd).to(dtype).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offsets, (normed * weight).to(dtype), mask=mask)


def all_reduce_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                            buffers: torch.Tensor, pads: torch.Tensor, epochs: torch.Tensor, rank: int, world: int
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(sum over ranks of x + residual) * weight, that sum + residual) for contiguous x, residual [T, H].
    buffers / pads: int64 device tensors of every rank's symmetric buffer (two halves of R x H of x's dtype) and
    signal pad (R x world uint32 flags, zero at first) addresses, in rank order; epochs: this rank's R int32 call
    counts (zero at first). T <= R; every rank calls it with the same T, in the same order."""
    num_tokens, hidden = x.shape
    y, new_residual = torch.empty_like(x), torch.empty_like(x)
    if num_tokens:
        block = triton.next_power_of_2(hidden)
        _all_reduce_add_rms_norm_kernel[(num_tokens,)](
            x, residual, weight, y, new_residual, buffers, pads, epochs, eps, HIDDEN=hidden, BLOCK=block,
            ROWS=epochs.shape[0], RANK=rank, WORLD=world, num_warps=4 if block <= 1024 else 8)
    return y, new_residual
