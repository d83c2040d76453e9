"""The experts of a mixture-of-experts FFN in two Triton launches (GPU), after routing.

A decode step of a few tokens (at most ROW_SLOTS (token, choice) slots) runs them as matrix-vector products, as
kernels/gemv.py does for dense layers (one token's row meets each weight once: no tensor cores, the speed is that of
streaming the experts' bytes). Launch 1: a program per few gate and up rows of one slot's expert, act(gate) * up
written per slot. Launch 2: a program per few output columns of one token, summing its k slots' down products times
their routing weights in registers and writing the token's row in the model's dtype (no atomics, no zeroed sums).

More slots are grouped by expert, each expert's run padded to whole row tiles (kernels/moe_align.py, no host
synchronisation), so one tile of rows belongs to one expert. Tile sizes follow the slots an expert gets (tile_config);
each launch's programs take groups of row tiles, a column block at a time (_place), so a prefill's rows and weights
are read from L2 by a group's programs rather than again from memory by each column block.
Launch 1, a grouped GEMM over all experts: each tile's tokens times its expert's gate and up rows, act(gate) * up
written per slot; its programs also zero launch 2's fp32 sums. Launch 2: those rows times the expert's down
projection, scaled by the slot's routing weight and added into the token's output in the epilogue (fp32 atomics: a
token's k slots meet there). The torch reference is layers/moe.py's expert loop.

Quantized experts (int8 or float8_e4m3fn codes, an fp32 scale per output channel of each expert: quantization='int8',
'w8a8', 'int4' or 'fp8'): the kernels read the codes (half the bytes), widen them (exact: int8 and e4m3 values are bf16
values) and scale each output column.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from fasterllm.kernels.activation import ACTIVATIONS, activate
from fasterllm.kernels.dependent_launch import early_launch, early_start
from fasterllm.kernels.gemv import CANDIDATES, DEFAULT, add_chunk_product, load_weight_chunk
from fasterllm.kernels.moe_align import align_by_expert
from fasterllm.kernels.online_softmax import dot
from fasterllm.kernels.tile_timer import timed_tile


@triton.jit
def _place(num_tiles, num_columns, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's row tile and column block. Programs run in groups of GROUP_M row tiles (mostly one expert's):
    consecutive programs take one column block of the group's tiles, then the next block, so a wave of programs
    reads a few tiles' rows and a few column blocks of their expert's weights, which stay in L2 for the group, where
    tile-major order read every tile's rows again for each column block."""
    program = tl.program_id(0)
    group_size = GROUP_M * tl.cdiv(num_columns, BLOCK_N)
    first = program // group_size * GROUP_M
    tiles_in_group = tl.minimum(num_tiles - first, GROUP_M)
    return first + program % group_size % tiles_in_group, program % group_size // tiles_in_group


@triton.jit
def _tile(slots_ptr, num_slots, tile, column_block, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The tile's rows of grouped slots, their slot ids, which are real (not padding), and the block's columns."""
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(slots_ptr + rows)
    columns = column_block * BLOCK_N + tl.arange(0, BLOCK_N)
    return rows, slots, slots < num_slots, columns


@triton.jit
def _zero_share(ptr, numel, ZERO_BLOCK: tl.constexpr):
    """This program's share of the numel fp32 values at ptr set to zero: the grid's programs take whole ZERO_BLOCK
    runs in turn (aligned stores), as many each as it takes to cover them all."""
    program = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    share = tl.cdiv(tl.cdiv(numel, tl.num_programs(0) * tl.num_programs(1)), ZERO_BLOCK) * ZERO_BLOCK
    for start in range(program * share, tl.minimum(numel, (program + 1) * share), ZERO_BLOCK):
        at = start + tl.arange(0, ZERO_BLOCK)
        tl.store(ptr + at, tl.zeros([ZERO_BLOCK], dtype=tl.float32), mask=at < numel)


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, scale_ptr, out_ptr, sums_ptr, num_sums, slots_ptr, tile_experts_ptr, num_tiles,
                    num_slots, hidden, inter, stride_xt, stride_we, stride_wn, stride_se, stride_os,
                    TOP_K: tl.constexpr, NUM_EXPERTS: tl.constexpr, ACT: tl.constexpr, IEEE: tl.constexpr,
                    SCALED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    GROUP_M: tl.constexpr, PDL: tl.constexpr):
    early_start(PDL)
    _zero_share(sums_ptr, num_sums, 1024)  # the down launch's fp32 sums start at zero: no memset launch of their own
    tile, column_block = _place(num_tiles, inter, BLOCK_N, GROUP_M)
    expert = tl.load(tile_experts_ptr + tile)
    if expert < NUM_EXPERTS:  # tiles past the last expert's run hold no slot
        rows, slots, valid, columns = _tile(slots_ptr, num_slots, tile, column_block, BLOCK_M, BLOCK_N)
        tokens = tl.where(valid, slots // TOP_K, 0)
        gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        weights = w_ptr + expert.to(tl.int64) * stride_we
        for k0 in range(0, hidden, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + tokens[:, None] * stride_xt + ks[None, :],
                        mask=valid[:, None] & (ks[None, :] < hidden), other=0.0)
            w_mask = (ks[:, None] < hidden) & (columns[None, :] < inter)
            w_gate = tl.load(weights + columns[None, :] * stride_wn + ks[:, None], mask=w_mask, other=0.0)
            w_up = tl.load(weights + (columns[None, :] + inter) * stride_wn + ks[:, None], mask=w_mask, other=0.0)
            gate += dot(x, w_gate.to(x.dtype), IEEE)
            up += dot(x, w_up.to(x.dtype), IEEE)
        if SCALED:  # codes: each output column's scale
            scales = scale_ptr + expert.to(tl.int64) * stride_se + columns
            gate *= tl.load(scales, mask=columns < inter, other=0.0)[None, :]
            up *= tl.load(scales + inter, mask=columns < inter, other=0.0)[None, :]
        gated = activate(gate, ACT) * up
        tl.store(out_ptr + rows[:, None] * stride_os + columns[None, :], gated.to(out_ptr.dtype.element_ty),
                 mask=valid[:, None] & (columns[None, :] < inter))


@triton.jit
def _down_kernel(a_ptr, w_ptr, scale_ptr, out_ptr, slots_ptr, tile_experts_ptr, routing_ptr, num_tiles, num_slots,
                 hidden, inter, stride_as, stride_we, stride_wn, stride_se, stride_ot, TOP_K: tl.constexpr,
                 NUM_EXPERTS: tl.constexpr, IEEE: tl.constexpr, SCALED: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PDL: tl.constexpr):
    early_start(PDL)
    tile, column_block = _place(num_tiles, hidden, BLOCK_N, GROUP_M)
    expert = tl.load(tile_experts_ptr + tile)
    if expert < NUM_EXPERTS:
        rows, slots, valid, columns = _tile(slots_ptr, num_slots, tile, column_block, BLOCK_M, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        weights = w_ptr + expert.to(tl.int64) * stride_we
        for k0 in range(0, inter, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(a_ptr + rows[:, None] * stride_as + ks[None, :],
                        mask=valid[:, None] & (ks[None, :] < inter), other=0.0)
            w = tl.load(weights + columns[None, :] * stride_wn + ks[:, None],
                        mask=(ks[:, None] < inter) & (columns[None, :] < hidden), other=0.0)
            acc += dot(a, w.to(a.dtype), IEEE)
        if SCALED:
            acc *= tl.load(scale_ptr + expert.to(tl.int64) * stride_se + columns, mask=columns < hidden,
                           other=0.0)[None, :]
        routing = tl.load(routing_ptr + slots, mask=valid, other=0.0).to(tl.float32)
        tokens = tl.where(valid, slots // TOP_K, 0)
        tl.atomic_add(out_ptr + tokens[:, None] * stride_ot + columns[None, :], acc * routing[:, None],
                      mask=valid[:, None] & (columns[None, :] < hidden))


@triton.jit
def _weight_rows_dot(rows, x_row, k_size, n_mask, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """[BLOCK_N] fp32: the weight rows starting at rows (pointers [BLOCK_N]) times the k_size values at x_row, in
    gemv.py's chunks."""
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, k_size, BLOCK_K):
        acc = add_chunk_product(acc, load_weight_chunk(rows, n_mask, k0, k_size, BLOCK_K, False), x_row, k0, k_size,
                                BLOCK_K, False, False)
    return acc


@triton.jit
def _gate_up_rows_kernel(x_ptr, w_ptr, scale_ptr, out_ptr, experts_ptr, hidden, inter, stride_xt, stride_we,
                         stride_wn, stride_se, stride_os, TOP_K: tl.constexpr, ACT: tl.constexpr, SCALED: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    early_start(PDL)
    slot = tl.program_id(0)
    expert = tl.load(experts_ptr + slot).to(tl.int64)
    columns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    c_mask = columns < inter
    gate_rows = w_ptr + expert * stride_we + columns.to(tl.int64) * stride_wn
    x_row = x_ptr + (slot // TOP_K) * stride_xt
    gate = _weight_rows_dot(gate_rows, x_row, hidden, c_mask, BLOCK_K, BLOCK_N)
    up = _weight_rows_dot(gate_rows + inter * stride_wn, x_row, hidden, c_mask, BLOCK_K, BLOCK_N)
    if SCALED:
        scales = scale_ptr + expert * stride_se + columns
        gate *= tl.load(scales, mask=c_mask, other=0.0)
        up *= tl.load(scales + inter, mask=c_mask, other=0.0)
    gated = activate(gate, ACT) * up
    tl.store(out_ptr + slot * stride_os + columns, gated.to(out_ptr.dtype.element_ty), mask=c_mask)


@triton.jit
def _down_rows_kernel(a_ptr, w_ptr, scale_ptr, out_ptr, experts_ptr, routing_ptr, hidden, inter, stride_as, stride_we,
                      stride_wn, stride_se, stride_ot, TOP_K: tl.constexpr, SCALED: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    early_start(PDL)
    token = tl.program_id(0)
    columns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    c_mask = columns < hidden
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < inter
        for choice in tl.static_range(TOP_K):  # unrolled: the k slots' weight loads are in flight together
            slot = token * TOP_K + choice
            expert = tl.load(experts_ptr + slot).to(tl.int64)
            weight = tl.load(routing_ptr + slot).to(tl.float32)
            if SCALED:
                weight *= tl.load(scale_ptr + expert * stride_se + columns, mask=c_mask, other=0.0)
            a = tl.load(a_ptr + slot * stride_as + ks, mask=k_mask, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + expert * stride_we + columns[:, None].to(tl.int64) * stride_wn + ks[None, :],
                        mask=c_mask[:, None] & k_mask[None, :], other=0.0, eviction_policy="evict_first")
            total += weight * tl.sum(w.to(tl.float32) * a[None, :], axis=1)
    tl.store(out_ptr + token * stride_ot + columns, total.to(out_ptr.dtype.element_ty), mask=c_mask)


# at most this many (token, choice) slots run as matrix-vector products: on an H200 at Qwen3-30B-A3B's experts (top 8)
# they took 27.4 against the tiles' 33.8 us for one token, 47.2 against 50.5 for two, 89.7 against 86.1 for four
ROW_SLOTS = 16


# this few (token, choice) slots (a decode step of a few tokens) are not grouped: a tile per slot reads its expert's
# weights once per slot, and the grouping's launches cost more than the few repeated reads save
UNGROUPED_SLOTS = 32


@functools.lru_cache(maxsize=256)
def one_slot_per_tile(num_slots: int, block_m: int, device: torch.device) -> torch.Tensor:
    """The grouped-slots layout of num_slots tiles of one slot each (slot i in row 0 of tile i, the rest padding); the
    tiles' experts are the slots' own. Made once per size (outside CUDA-graph capture: its warm-up makes it)."""
    slots = torch.full((num_slots, block_m), num_slots, dtype=torch.int32, device=device)
    slots[:, 0] = torch.arange(num_slots, dtype=torch.int32, device=device)
    return slots.flatten()


class TileConfig(NamedTuple):
    block_m: int  # slots (token, choice) per tile, all of one expert
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# by the (token, choice) slots an expert gets on average: the fastest of benchmarks/moe_kernel_gpu.py's sweep on an
# H100 at Qwen3-30B-A3B's experts, then of its sweep and candidates timed on an H200 at Mixtral-8x7B's and Qwen3-30B-
# A3B's (RESULTS.md, twenty-seventh session). Few slots: each tile reads its expert's weights in long K steps; from 64
# slots an expert 128-row tiles, so that an expert whose slots spill past one tile does not read its weights twice
TILE_CONFIGS = ((8, TileConfig(16, 64, 128, 4, 3)), (32, TileConfig(32, 64, 128, 4, 3)),
                (64, TileConfig(64, 128, 64, 8, 4)), (None, TileConfig(128, 128, 64, 8, 3)))
# what any device can hold (shared memory): the fallback where a larger tile does not compile
SMALL_TILES = TileConfig(16, 64, 32, 4, 2)
GROUP_M = 8  # row tiles a group of the grouped GEMMs' programs shares (_place)


def tile_config(num_slots: int, num_experts: int) -> TileConfig:
    """The tiles for num_slots (token, choice) pairs over num_experts experts."""
    per_expert = num_slots / num_experts
    return next(config for below, config in TILE_CONFIGS if below is None or per_expert < below)


def fused_experts(hidden: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, routing_weights: torch.Tensor,
                  experts: torch.Tensor, activation: str, config: TileConfig | None = None,
                  scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """hidden [T, H], w_gate_up [E, 2I, H], w_down [E, H, I], routing_weights and experts [T, k] -> [T, H]: sum over a
    token's k experts of weight * down(act(gate(x)) * up(x)). config: the grouped GEMM's tiles, also for a few slots
    (default: matrix-vector products for at most ROW_SLOTS slots, else tile_config's). scales: the weights are codes,
    and these their fp32 scales per output channel, ([E, 2I], [E, H])."""
    num_tokens, hidden_size = hidden.shape
    num_experts, double_inter, _ = w_gate_up.shape
    inter, top_k = double_inter // 2, experts.shape[1]
    if w_down.shape != (num_experts, hidden_size, inter) or w_gate_up.shape[2] != hidden_size:
        raise ValueError(f"w_gate_up {tuple(w_gate_up.shape)} must be [E, 2I, H={hidden_size}] and w_down "
                         f"{tuple(w_down.shape)} [E, H, I]")
    if scales is not None and (scales[0].shape != w_gate_up.shape[:2] or scales[1].shape != w_down.shape[:2]):
        raise ValueError(f"scales {tuple(scales[0].shape)} and {tuple(scales[1].shape)} must be [E, 2I] and [E, H], "
                         f"one per output channel of w_gate_up {tuple(w_gate_up.shape)} and w_down "
                         f"{tuple(w_down.shape)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation {activation!r} is not one of {', '.join(ACTIVATIONS)}")
    hidden, w_gate_up, w_down = hidden.contiguous(), w_gate_up.contiguous(), w_down.contiguous()
    if config is None and num_tokens * top_k <= ROW_SLOTS:
        return _launch_rows(hidden, w_gate_up, w_down, routing_weights, experts, activation, scales)
    config = config or tile_config(num_tokens * top_k, num_experts)
    try:
        return _launch(hidden, w_gate_up, w_down, routing_weights, experts, activation, config, scales)
    except triton.runtime.errors.OutOfResources:  # a device with less shared memory than the tile needs
        return _launch(hidden, w_gate_up, w_down, routing_weights, experts, activation, SMALL_TILES, scales)


def _launch(hidden: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, routing_weights: torch.Tensor,
            experts: torch.Tensor, activation: str, config: TileConfig,
            scales: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    num_tokens, hidden_size = hidden.shape
    num_experts, double_inter, _ = w_gate_up.shape
    inter, top_k = double_inter // 2, experts.shape[1]
    m, n, k, warps, stages = config
    if num_tokens * top_k <= UNGROUPED_SLOTS:
        slots, tile_experts = one_slot_per_tile(num_tokens * top_k, m, hidden.device), experts.flatten()
    else:
        slots, tile_experts = align_by_expert(experts, num_experts, m)
    gated = torch.empty(slots.shape[0], inter, dtype=hidden.dtype, device=hidden.device)
    out = torch.empty(num_tokens, hidden_size, dtype=torch.float32, device=hidden.device)  # zeroed by launch 1
    ieee = hidden.dtype == torch.float32  # full fp32 products, not TF32, for fp32 models
    gate_up_scales, down_scales = (w_gate_up, w_down) if scales is None else (s.contiguous() for s in scales)
    num_tiles = tile_experts.shape[0]
    _gate_up_kernel[(num_tiles * triton.cdiv(inter, n),)](
        hidden, w_gate_up, gate_up_scales, gated, out, out.numel(), slots, tile_experts, num_tiles,
        num_tokens * top_k, hidden_size, inter, hidden.stride(0), w_gate_up.stride(0), w_gate_up.stride(1),
        gate_up_scales.stride(0), gated.stride(0),
        TOP_K=top_k, NUM_EXPERTS=num_experts, ACT=ACTIVATIONS[activation], IEEE=ieee, SCALED=scales is not None,
        BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, GROUP_M=GROUP_M, num_warps=warps, num_stages=stages,
        **early_launch(hidden.device))
    _down_kernel[(num_tiles * triton.cdiv(hidden_size, n),)](
        gated, w_down, down_scales, out, slots, tile_experts, routing_weights.contiguous(), num_tiles,
        num_tokens * top_k, hidden_size, inter, gated.stride(0), w_down.stride(0), w_down.stride(1),
        down_scales.stride(0), out.stride(0), TOP_K=top_k, NUM_EXPERTS=num_experts, IEEE=ieee,
        SCALED=scales is not None, BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, GROUP_M=GROUP_M, num_warps=warps,
        num_stages=stages, **early_launch(hidden.device))
    return out.to(hidden.dtype)


def _launch_rows(hidden: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, routing_weights: torch.Tensor,
                 experts: torch.Tensor, activation: str, scales: tuple[torch.Tensor, torch.Tensor] | None
                 ) -> torch.Tensor:
    """The few-slot launches: matrix-vector products, each launch's tile (one of gemv's) timed once per shape."""
    num_tokens, hidden_size = hidden.shape
    num_experts, double_inter, _ = w_gate_up.shape
    inter, top_k = double_inter // 2, experts.shape[1]
    experts, routing_weights = experts.contiguous(), routing_weights.contiguous()
    gated = torch.empty(num_tokens * top_k, inter, dtype=hidden.dtype, device=hidden.device)
    out = torch.empty_like(hidden)
    gate_up_scales, down_scales = (w_gate_up, w_down) if scales is None else (s.contiguous() for s in scales)
    pdl = early_launch(hidden.device)

    def gate_up(tile: tuple[int, int, int]) -> None:
        block_n, block_k, warps = tile
        _gate_up_rows_kernel[(num_tokens * top_k, triton.cdiv(inter, block_n))](
            hidden, w_gate_up, gate_up_scales, gated, experts, hidden_size, inter, hidden.stride(0),
            w_gate_up.stride(0), w_gate_up.stride(1), gate_up_scales.stride(0), gated.stride(0), TOP_K=top_k,
            ACT=ACTIVATIONS[activation], SCALED=scales is not None, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
            **pdl)

    def down(tile: tuple[int, int, int]) -> None:
        block_n, block_k, warps = tile
        _down_rows_kernel[(num_tokens, triton.cdiv(hidden_size, block_n))](
            gated, w_down, down_scales, out, experts, routing_weights, hidden_size, inter, gated.stride(0),
            w_down.stride(0), w_down.stride(1), down_scales.stride(0), out.stride(0), TOP_K=top_k,
            SCALED=scales is not None, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, **pdl)

    shape = (num_tokens, top_k, hidden_size, inter, w_gate_up.dtype, hidden.dtype)
    gate_up(timed_tile(("moe gate_up", *shape, hidden.device), gate_up, CANDIDATES, DEFAULT))
    down(timed_tile(("moe down", *shape, hidden.device), down, CANDIDATES, DEFAULT))
    return out
