"""A mixture of experts' (token, choice) slots grouped by expert for the fused kernels (kernels/fused_moe.py), in
Triton launches with no host synchronisation: count each expert's slots, pad each run to whole row tiles and find
every tile's expert, then place each slot in its expert's run. A run's slots come in no set order (atomics place
them): each row of a tile is computed on its own, so the order changes nothing. It replaced a dozen torch ops (a
stable argsort among them): 49 us of a one-token layer and 134 us of a 2,048-token one on an H100."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fasterllm.kernels.dependent_launch import early_launch, early_start

_BLOCK = 1024  # slots per program of the counting and placing launches


@triton.jit
def _count_kernel(experts_ptr, counts_ptr, num_slots, BLOCK: tl.constexpr, PDL: tl.constexpr):
    early_start(PDL)
    slot = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    expert = tl.load(experts_ptr + slot, mask=slot < num_slots, other=0)
    tl.atomic_add(counts_ptr + expert, 1, mask=slot < num_slots)


@triton.jit
def _runs_kernel(counts_ptr, cursor_ptr, tile_experts_ptr, slots_ptr, num_experts, num_tiles, size, sentinel,
                 BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """One program: each expert's run start (the placing cursor), each tile's expert (the number of runs that end at
    or before its first row: num_experts past the last run), and every slot position set to the padding sentinel."""
    early_start(PDL)
    e = tl.arange(0, BLOCK_E)
    real = e < num_experts
    padded = (tl.load(counts_ptr + e, mask=real, other=0) + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    tl.store(cursor_ptr + e, ends - padded, mask=real)
    for first in range(0, num_tiles, BLOCK):
        tile = first + tl.arange(0, BLOCK)
        passed = (ends[None, :] <= (tile * BLOCK_M)[:, None]) & real[None, :]
        tl.store(tile_experts_ptr + tile, tl.sum(passed.to(tl.int32), axis=1), mask=tile < num_tiles)
    for first in range(0, size, BLOCK):
        position = first + tl.arange(0, BLOCK)
        tl.store(slots_ptr + position, tl.full((BLOCK,), sentinel, tl.int32), mask=position < size)


@triton.jit
def _place_kernel(experts_ptr, cursor_ptr, slots_ptr, num_slots, BLOCK: tl.constexpr, PDL: tl.constexpr):
    early_start(PDL)
    slot = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    expert = tl.load(experts_ptr + slot, mask=slot < num_slots, other=0)
    position = tl.atomic_add(cursor_ptr + expert, 1, mask=slot < num_slots)
    tl.store(slots_ptr + position, slot.to(tl.int32), mask=slot < num_slots)


def align_by_expert(experts: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """experts [T, k] -> (slots [P] int32: the (token * k + choice) slots grouped by expert, each expert's run padded
    with the sentinel T * k to a multiple of block_m; tile_experts [P / block_m] int32: each tile's expert, or
    num_experts past the last run). P is the bound T * k + E * (block_m - 1), rounded up: no host synchronisation."""
    flat = experts.flatten()
    num_slots, device = flat.numel(), flat.device
    size = -(-(num_slots + num_experts * (block_m - 1)) // block_m) * block_m
    counts = torch.zeros(num_experts, dtype=torch.int32, device=device)
    cursor = torch.empty(num_experts, dtype=torch.int32, device=device)
    slots = torch.empty(size, dtype=torch.int32, device=device)
    tile_experts = torch.empty(size // block_m, dtype=torch.int32, device=device)
    grid = (triton.cdiv(num_slots, _BLOCK),)
    _count_kernel[grid](flat, counts, num_slots, BLOCK=_BLOCK, **early_launch(device))
    _runs_kernel[(1,)](counts, cursor, tile_experts, slots, num_experts, size // block_m, size, num_slots,
                       BLOCK_M=block_m, BLOCK_E=triton.next_power_of_2(num_experts), BLOCK=256, **early_launch(device))
    _place_kernel[grid](flat, cursor, slots, num_slots, BLOCK=_BLOCK, **early_launch(device))
    return slots, tile_experts
