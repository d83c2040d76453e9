"""A few rows times an int4 weight in tinygemm's layout on tensor cores (Gluon, NVIDIA GPUs of compute capability
8.0+): batched decode's 4-bit products, 1-64 rows (the engine sends it 2-64: one row takes int4_gemv.py).

tinygemm's layout (pack_int4_tinygemm, quant_weight_only.py) was made for mma.sync m16n8k16: in each block of 8
weight rows and tile of 32 k, word l = 4 r + j holds row r's nibbles p and p + 4 at k = 8 p + 2 j and 8 p + 2 j + 1,
exactly the k pair (b0, b1) or (b2, b3) that the mma's B fragment gives lane l for k tile p // 2. So lane l of a warp
reads word l from shared memory and makes its B fragments in registers: one lop3 a pair turns the two codes into
the bf16 values 128 + q (magic 0x4300), one bf16x2 fused multiply-add subtracts 136 (exact: q - 8), one more
multiplies by the group's scale and adds its zero (one rounding, as the reference's weight is rounded once); the
register relabelling into the mma's layout is free (asserted at compile time). Above 8 rows the product is x W^T:
A = x [BM, 32] a tile (BM 16-64 rows, padding rows zero), B = W^T [32, BN], a warp taking NB blocks of 8 output
columns. At 1-8 rows it is W x^T (WEIGHT_A): the same words make the A fragments of 16-row tiles (lane 4 r + j's
words of two blocks of 8 rows are its registers (a0, a2) and (a1, a3)), x^T [32, 8] is B, and no mma row is padding
but x's rows past M. H200, 8B projections: 2-17% faster a product than x W^T at 2-8 rows (a batch of 8 decodes in
2.84 ms against 3.17), 7-13% faster than int4_gemv.py at one row alone, yet slower in the one-row decode step in
every form tried (its split of K summed by a second launch or inside this one, with int4_gemv's weight prefetch under
programmatic dependent launch, or for some projections only: RESULTS.md, thirtieth session). On Hopper (sm_90;
Blackwell has no wgmma) 9-64 rows may also take W x^T through wgmma: the same words are the register A operand (a
warpgroup's 4 warps, 16 weight rows each of a 64-row instruction), x^T [32, BM] is B, read by the tensor cores
straight from shared memory in wgmma's swizzle. A step's tiles are dequantized first, then their wgmmas issued
together and waited for at the step's end (with one left in flight across the loop's back edge, ptxas serializes
every wgmma). H200, 64 rows: gate_up 1.42x, down 1.25x, qkv 1.15x faster than x W^T through mma.sync (4 m-tiles
of mma.sync a word there), o 5% slower: the form is timed with the tile.

Words, (scale, zero) pairs and x tiles stream into shared memory through cp.async, STAGES steps of TK tiles in
flight: with one step at a time (loads, then the arithmetic) the kernel ran at 1.0-1.2x bf16 cuBLAS where the copies
ahead give 1.6-2.0x (16 rows, H200). K is split across programs (quant_split_k.plan_split_k) when the columns alone
would leave SMs idle; reduce_splits adds the fp32 partials in a fixed order. The kernel is launched without
programmatic dependent launch: with it, the 8B shape's 64-row decode step took 5.75-6.09 ms, without it 5.25 ms
(H200; the next kernel's waiting programs take places this one needs). Its form and tile are timed per shape
(tile_timer.py) among the candidates whose shared memory the GPU allows.
Triton's interpreter cannot run Gluon: CI checks the two facts above in torch (tests/kernels/test_int4_mma.py), the
GPU tests run the kernel against tinygemm_reference and torch's kernel.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from fasterllm.kernels.quant_split_k import nvidia_capability, plan_split_k, reduce_splits, shared_memory_limit
from fasterllm.kernels.tile_timer import timed_tile



def _dequantize_asm() -> str:
    """PTX: a word ($4), its group's scale and zero each as a bf16x2 pair ($5, $6) -> the 4 bf16x2 weights $0..$3
    (k 8 i + 2 j and 8 i + 2 j + 1 for i = 0..3): (128 + q) from one lop3 of the word shifted by 4 i, minus 136
    (exact), times the scale plus the zero (one rounding)."""
    lines = [".reg .b32 c, w, one, bias;", "mov.b32 one, 0x3F803F80;", "mov.b32 bias, 0xC308C308;"]
    for i in range(4):
        lines += ([f"shr.u32 w, $4, {4 * i};"] if i else ["mov.b32 w, $4;"]) + [
            "lop3.b32 c, w, 0x000F000F, 0x43004300, 0xEA;", "fma.rn.bf16x2 c, c, one, bias;",
            f"fma.rn.bf16x2 ${i}, c, $5, $6;"]
    return "{\n" + "\n".join(lines) + "\n}"


_DEQUANTIZE = gl.constexpr(_dequantize_asm())


@gluon.jit
def _scales_and_zeros(pairs):
    """(scale, zero) bf16 pairs as int32 -> (scale, scale) and (zero, zero) as int32 bf16x2 words."""
    return gl.inline_asm_elementwise("prmt.b32 $0, $2, 0, 0x1010; prmt.b32 $1, $2, 0, 0x3232;", "=r,=r,r", [pairs],
                                     dtype=(gl.int32, gl.int32), is_pure=True, pack=1)


@gluon.jit
def _bf16_halves(pairs):
    """int32 bf16x2 words [..] -> bf16 [.., 2] (low half first)."""
    low = (pairs & 0xFFFF).to(gl.int16).to(gl.bfloat16, bitcast=True)
    high = (pairs >> 16).to(gl.int16).to(gl.bfloat16, bitcast=True)
    return gl.join(low, high)


@gluon.jit
def _weight_tile(words, scales, zeros, BN: gl.constexpr, B_LAYOUT: gl.constexpr):
    """words [4, BN] int32 of one 32-k tile (lane j, column n) and their group's scales and zeros (bf16x2, [1, BN])
    -> W^T [32, BN] in the mma's B layout, with no data movement."""
    w0, w1, w2, w3 = gl.inline_asm_elementwise(_DEQUANTIZE, "=r,=r,=r,=r,r,r,r", [words, scales, zeros],
                                               dtype=(gl.int32, gl.int32, gl.int32, gl.int32), is_pure=True, pack=1)
    by_i = gl.join(gl.join(w0, w1), gl.join(w2, w3))  # [j, n, i % 2, i // 2]
    by_k = gl.reshape(gl.permute(by_i, (3, 2, 0, 1)), (16, BN))  # k / 2 = 4 i + j
    halves = gl.reshape(gl.permute(_bf16_halves(by_k), (0, 2, 1)), (32, BN))  # k = 2 (k / 2) + half
    return gl.convert_layout(halves, B_LAYOUT, assert_trivial=True)


@gluon.jit
def _weight_tile_a(words, scales, zeros, BN: gl.constexpr, A_LAYOUT: gl.constexpr):
    """words [4 (j), BN / 16, 2, 8 (r)] of one 32-k tile (row n = 16 (n // 16) + 8 half + r: two blocks of 8 rows
    form a 16-row A tile) and their group's scales and zeros (bf16x2, same shape) -> W [BN, 32] in the mma's A
    layout, with no data movement: lane 4 r + j's words of the two blocks are its A registers (a0, a2) and (a1, a3)."""
    w0, w1, w2, w3 = gl.inline_asm_elementwise(_DEQUANTIZE, "=r,=r,=r,=r,r,r,r", [words, scales, zeros],
                                               dtype=(gl.int32, gl.int32, gl.int32, gl.int32), is_pure=True, pack=1)
    by_i = gl.join(gl.join(w0, w1), gl.join(w2, w3))  # [j, n // 16, half, r, i % 2, i // 2]
    by_k = gl.permute(by_i, (1, 2, 3, 5, 4, 0))  # k / 2 = 8 (i // 2) + 4 (i % 2) + j
    halves = gl.reshape(_bf16_halves(gl.reshape(by_k, (BN, 16))), (BN, 32))  # k = 2 (k / 2) + half
    return gl.convert_layout(halves, A_LAYOUT, assert_trivial=True)


@gluon.jit
def _issue_step(words_at, words_live, pairs_at, pairs_live, x_at, x_live, words_bufs, pairs_bufs, x_bufs, slot, t0,
                t_end, N, TK: gl.constexpr, TP: gl.constexpr, TILES_PER_GROUP: gl.constexpr, EVEN: gl.constexpr):
    """Start copying one step's words, (scale, zero) pairs and x tiles (tiles t0 .. t0 + TK) into slot of each tile's
    own buffers. Rows past M copy as zeros; so do tiles past t_end and columns past N unless EVEN (none there)."""
    for t in gl.static_range(TK):
        tile_live = t0 + t < t_end
        async_copy.async_copy_global_to_shared(words_bufs[t].index(slot), words_at + (t0 + t) * 32,
                                               mask=words_live if EVEN else words_live & tile_live)
        async_copy.async_copy_global_to_shared(x_bufs[t].index(slot), x_at + (t0 + t) * 32,
                                               mask=x_live if EVEN else x_live & tile_live)
    for t in gl.static_range(TP):
        rows_at = pairs_at + ((t0 + t) // TILES_PER_GROUP) * N
        if EVEN:
            async_copy.async_copy_global_to_shared(pairs_bufs[t].index(slot), rows_at)
        else:
            async_copy.async_copy_global_to_shared(pairs_bufs[t].index(slot), rows_at,
                                                   mask=pairs_live & (t0 + t < t_end))


# M is not specialized: the row count changes from step to step (see quant_weight_only.py)
@gluon.jit(do_not_specialize=["M"])
def _int4_mma_kernel(x_ptr, w_ptr, sz_ptr, bias_ptr, out_ptr, M, N, K, tiles_per_split,
                     GROUP: gl.constexpr, BM: gl.constexpr, NB: gl.constexpr, TK: gl.constexpr,
                     WARPS: gl.constexpr, STAGES: gl.constexpr, EVEN: gl.constexpr, SPLIT: gl.constexpr,
                     HAS_BIAS: gl.constexpr, WEIGHT_A: gl.constexpr, WGMMA: gl.constexpr):
    BN: gl.constexpr = 8 * NB * WARPS
    TILES_PER_GROUP: gl.constexpr = GROUP // 32
    # (scale, zero) rows a step: one where a step lies inside one group, else one a tile
    TP: gl.constexpr = 1 if TILES_PER_GROUP % TK == 0 else TK
    ACC_ROWS: gl.constexpr = BM if WGMMA else 8  # x rows W x^T multiplies: wgmma's N, or mma.sync's 8
    if WEIGHT_A:  # W x^T: acc [BN, ACC_ROWS], warps along the weight rows
        if WGMMA:  # on Hopper: a warpgroup's 4 warps, 16 weight rows each of a 64-row instruction
            MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                          instr_shape=[16, BM, 16])
        else:
            MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WARPS, 1],
                                                          instr_shape=[16, 8])
        # a tile's words [4, BN / 16, 2, 8]: lane 4 r + j, warp (n // 16) % WARPS, registers the half and NB // 2
        WORDS: gl.constexpr = gl.BlockedLayout([1, 1, 2, 1], [4, 1, 1, 8], [1, WARPS, 1, 1], [0, 3, 2, 1])
    else:  # x W^T: acc [BM, BN], warps along the output columns
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, WARPS], instr_shape=[16, 8])
        # a tile's words [4, BN]: lane = 4 (n % 8) + j, warp = (n // 8) % WARPS, registers the warp's NB blocks
        WORDS: gl.constexpr = gl.BlockedLayout([1, 1], [4, 8], [1, WARPS], [0, 1])
    A_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    B_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    PLAIN: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    if WGMMA:  # x^T is wgmma's B, read from shared memory: its own swizzle (a row of 32 bf16 is 64 bytes)
        X_SHARED: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=16, rank=2)
    else:
        X_SHARED: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=2, max_phase=4, order=[1, 0])
    # one allocation a tile of a step (its STAGES slots): Triton 3.6 waits at a barrier after each cp.async into
    # part of an allocation, so one allocation for all tiles cost TK - 1 more barriers a step (up to 10% at 16 rows)
    words_bufs = ()
    x_bufs = ()
    pairs_bufs = ()
    for t in gl.static_range(TK):
        words_bufs = words_bufs + (gl.allocate_shared_memory(gl.int32, [STAGES, BN, 4], PLAIN),)
        x_bufs = x_bufs + (gl.allocate_shared_memory(gl.bfloat16, [STAGES, BM, 32], X_SHARED),)
    for t in gl.static_range(TP):
        pairs_bufs = pairs_bufs + (gl.allocate_shared_memory(gl.int32, [STAGES, 1, BN], PLAIN),)
    KT = K // 32
    pid_n, pid_k = gl.program_id(0), gl.program_id(1)
    t_begin = pid_k * tiles_per_split
    t_end = gl.minimum(KT, t_begin + tiles_per_split)
    steps = gl.cdiv(t_end - t_begin, TK)

    # where each thread's copies come from, tile 0: words [BN, 4] and x [BM, 32] 16 bytes a thread, pairs [1, BN]
    WORDS_IN: gl.constexpr = gl.BlockedLayout([1, 4], [32, 1], [WARPS, 1], [1, 0])
    PAIRS_IN: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [1, WARPS], [1, 0])
    X_IN: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [WARPS, 1], [1, 0])
    wn = pid_n * BN + gl.expand_dims(gl.arange(0, BN, layout=gl.SliceLayout(1, WORDS_IN)), 1)
    wj = gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(0, WORDS_IN)), 0)
    words_at = w_ptr + ((wn // 8).to(gl.int64) * (KT * 32) + (wn % 8) * 4 + wj)
    pn = pid_n * BN + gl.expand_dims(gl.arange(0, BN, layout=gl.SliceLayout(0, PAIRS_IN)), 0)
    xm = gl.expand_dims(gl.arange(0, BM, layout=gl.SliceLayout(1, X_IN)), 1)
    xk = gl.expand_dims(gl.arange(0, 32, layout=gl.SliceLayout(0, X_IN)), 0)
    x_at = x_ptr + (xm.to(gl.int64) * K + xk)
    words_live, pairs_live, x_live = wn < N, pn < N, xm < M

    for s in gl.static_range(STAGES - 1):
        if s < steps:
            _issue_step(words_at, words_live, sz_ptr + pn, pairs_live, x_at, x_live, words_bufs, pairs_bufs, x_bufs,
                        s, t_begin + s * TK, t_end, N, TK, TP, TILES_PER_GROUP, EVEN)
        async_copy.commit_group()
    if WEIGHT_A:
        acc = gl.zeros([BN, ACC_ROWS], gl.float32, layout=MMA)
    else:
        acc = gl.zeros([BM, BN], gl.float32, layout=MMA)
    for i in range(steps):
        async_copy.wait_group(STAGES - 2)  # step i's copies are in
        if WGMMA:
            fence_async_shared()  # ... and visible to wgmma's reads
        gl.thread_barrier()  # ... everyone's, and every warp is done with the slot the next copies overwrite
        ahead = i + STAGES - 1
        if ahead < steps:
            _issue_step(words_at, words_live, sz_ptr + pn, pairs_live, x_at, x_live, words_bufs, pairs_bufs, x_bufs,
                        ahead % STAGES, t_begin + ahead * TK, t_end, N, TK, TP, TILES_PER_GROUP, EVEN)
        async_copy.commit_group()
        slot = i % STAGES
        if WGMMA:  # the step's tiles dequantized, then its wgmmas issued together and waited for
            tiles = ()
            for t in gl.static_range(TK):
                if t < TP:
                    pairs = pairs_bufs[t].index(slot).reshape([1, BN // 16, 2, 8])
                    scales, zeros = _scales_and_zeros(pairs.load(WORDS))
                words = words_bufs[t].index(slot).permute([1, 0]).reshape([4, BN // 16, 2, 8]).load(WORDS)
                tiles = tiles + (_weight_tile_a(words, scales, zeros, BN, A_LAYOUT),)
            for t in gl.static_range(TK):
                acc = warpgroup_mma(tiles[t], x_bufs[t].index(slot).permute([1, 0]), acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=(acc,) + tiles)[0]
        else:
            for t in gl.static_range(TK):
                if t < TP:  # a (scale, zero) row: the step's group, or this tile's
                    pairs = pairs_bufs[t].index(slot)
                    if WEIGHT_A:
                        pairs = pairs.reshape([1, BN // 16, 2, 8])
                    scales, zeros = _scales_and_zeros(pairs.load(WORDS))
                words = words_bufs[t].index(slot).permute([1, 0])
                if WEIGHT_A:
                    x_t = x_bufs[t].index(slot).slice(0, 8, dim=0).permute([1, 0]).load(B_LAYOUT)
                    w_t = _weight_tile_a(words.reshape([4, BN // 16, 2, 8]).load(WORDS), scales, zeros, BN, A_LAYOUT)
                    acc = mma_v2(w_t, x_t, acc)
                else:
                    acc = mma_v2(x_bufs[t].index(slot).load(A_LAYOUT),
                                 _weight_tile(words.load(WORDS), scales, zeros, BN, B_LAYOUT), acc)
    async_copy.wait_group(0)

    if WEIGHT_A:
        on = pid_n * BN + gl.expand_dims(gl.arange(0, BN, layout=gl.SliceLayout(1, MMA)), 1)
        om = gl.expand_dims(gl.arange(0, ACC_ROWS, layout=gl.SliceLayout(0, MMA)), 0)
    else:
        om = gl.expand_dims(gl.arange(0, BM, layout=gl.SliceLayout(1, MMA)), 1)
        on = pid_n * BN + gl.expand_dims(gl.arange(0, BN, layout=gl.SliceLayout(0, MMA)), 0)
    mask = (om < M) & (on < N)
    if SPLIT:
        gl.store(out_ptr + pid_k * M * N + om * N + on, acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += gl.load(bias_ptr + on, mask=on < N, other=0.0).to(gl.float32)
        gl.store(out_ptr + om * N + on, acc.to(out_ptr.dtype.element_ty), mask=mask)


MAX_ROWS = 64
WEIGHT_A_MAX_ROWS = 8  # up to here W x^T (the weight as the A operand, x^T as an 8-column B), above x W^T
# (NB blocks of 8 columns a warp, TK tiles of 32 k a step, warps, programs per SM the split of K aims at, pipeline
# stages): tile_timer's candidates, each the fastest at one of the Llama-3-8B projections at 16 or 64 rows on an H200
# (benchmarks/RESULTS.md)
CANDIDATES = [(2, 2, 4, 4, 4), (2, 2, 4, 2, 3), (4, 4, 4, 2, 4), (4, 2, 4, 2, 4)]
DEFAULT = (4, 4, 4, 2, 4)  # a shape timed nowhere (a graph capture's first call), where it fits
# the same for 1-8 rows (NB even: two blocks of 8 weight rows make a 16-row A tile), each the fastest at one of those
# projections at 1-8 rows on an H200
WEIGHT_A_CANDIDATES = [(4, 2, 4, 4, 4), (4, 4, 4, 2, 4), (2, 4, 4, 4, 4)]
WEIGHT_A_DEFAULT = (4, 2, 4, 4, 4)
# the same for 9-64 rows through wgmma (one warpgroup a program): the first two the fastest at every one of those
# projections at 16-64 rows on an H200 (benchmarks/RESULTS.md), the third a narrower tile for other shapes
WGMMA_CANDIDATES = [(4, 4, 4, 2, 4), (2, 4, 4, 4, 4), (4, 2, 4, 4, 4)]
WGMMA_DEFAULT = (4, 4, 4, 2, 4)


class Form(NamedTuple):
    """One way the kernel multiplies: W x^T or x W^T, through wgmma or mma.sync, and the tiles it is timed over."""
    weight_a: bool
    wgmma: bool
    candidates: list[tuple[int, int, int, int, int]]
    default: tuple[int, int, int, int, int]


FORMS = {"w_xt": Form(True, False, WEIGHT_A_CANDIDATES, WEIGHT_A_DEFAULT),
         "x_wt": Form(False, False, CANDIDATES, DEFAULT),
         "w_xt_wgmma": Form(True, True, WGMMA_CANDIDATES, WGMMA_DEFAULT)}


def forms_for(m: int, device: torch.device) -> list[str]:
    """The forms that multiply m rows on this GPU (int4_mma times their tiles together and keeps the fastest): W x^T
    through mma.sync at 1-8 rows; above, W x^T through wgmma on Hopper (sm_90 only: Blackwell has no wgmma; H200,
    Llama-3-8B's projections: gate_up 1.4x faster than x W^T at 64 rows, o 5-9% slower at 16-64: RESULTS.md) and
    x W^T through mma.sync everywhere."""
    if m <= WEIGHT_A_MAX_ROWS:
        return ["w_xt"]
    return (["w_xt_wgmma"] if nvidia_capability(device) == (9, 0) else []) + ["x_wt"]


def shared_bytes(tile: tuple[int, int, int, int, int], block_m: int, group_size: int) -> int:
    """The shared memory the kernel takes with tile at block_m rows: each stage's words, x tiles and (scale, zero)
    rows (equal to what Triton 3.6 allocates for every candidate, compiled for sm_90: RESULTS.md)."""
    nb, tk, warps, _, stages = tile
    block_n = 8 * nb * warps
    pair_rows = 1 if (group_size // 32) % tk == 0 else tk
    return stages * (tk * (block_n * 16 + block_m * 64) + pair_rows * block_n * 4)


Tile = tuple[int, int, int, int, int]


def tiles_that_fit(shared_limit: int, block_m: int, group_size: int, candidates: list[Tile] = CANDIDATES) -> list[Tile]:
    """The candidates (CANDIDATES, or another form's: FORMS) whose shared memory a program may take on a GPU
    that allows shared_limit bytes (99 KiB on consumer Ampere and Ada GPUs: the largest candidate at 64 rows needs
    104 KiB); the smallest always fits an NVIDIA GPU of compute capability 8.0+."""
    fitting = [tile for tile in candidates if shared_bytes(tile, block_m, group_size) <= shared_limit]
    return fitting or [min(candidates, key=lambda tile: shared_bytes(tile, block_m, group_size))]



def int4_mma(x: torch.Tensor, packed: torch.Tensor, scale_zeros: torch.Tensor, group_size: int,
             bias: torch.Tensor | None = None, tile: tuple[int, int, int, int, int] | None = None,
             form: str | None = None) -> torch.Tensor:
    """x [M, K] bf16 (1 <= M <= MAX_ROWS; copied if its rows are not contiguous) times the int4 weight
    pack_int4_tinygemm made (int32 [N/8, K/32, 32, 1]; scale_zeros bf16 [K/group, N, 2], group_size a multiple of
    32) -> [M, N] bf16. NVIDIA GPUs of compute capability 8.0+. The form (forms_for: those the GPU runs at M rows)
    and tile are the pair timed fastest for the shape; form (one of forms_for's) instead, with or without tile (one of
    its candidates): tests, benchmarks."""
    m, k = x.shape
    n = packed.shape[0] * 8
    if not 1 <= m <= MAX_ROWS or packed.shape[1] * 32 != k or x.dtype != torch.bfloat16 or group_size % 32:
        raise ValueError(f"int4_mma takes 1..{MAX_ROWS} bf16 rows of K values and tinygemm's [N/8, K/32, 32, 1] words "
                         f"with groups of a multiple of 32, got x {tuple(x.shape)} {x.dtype}, words "
                         f"{tuple(packed.shape)}, group {group_size}")
    forms = forms_for(m, x.device)
    if tile is not None and (form not in forms or tile not in FORMS[form].candidates):
        raise ValueError(f"int4_mma at {m} rows on this GPU takes a tile of one of its forms {forms}, named with it "
                         f"(form=, tile= one of FORMS[form].candidates), got form {form!r}, tile {tile}")
    if form is not None and form not in forms:
        raise ValueError(f"int4_mma at {m} rows on this GPU runs the forms {forms}, got form {form!r}")
    x = x.contiguous()  # the kernel addresses row m at m K
    block_m = max(16, triton.next_power_of_2(m))  # x rows a program copies (mma.sync's W x^T multiplies the first 8)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)

    def launch(choice: tuple[str, Tile]) -> torch.Tensor:
        chosen_form, (nb, tk, warps, programs_per_sm, stages) = choice
        kind = FORMS[chosen_form]
        block_n, block_k = 8 * nb * warps, 32 * tk
        plan = plan_split_k(m, n, k, block_m, block_n, block_k, programs_per_sm, x.device)
        target = plan.partial_sums(out)
        split = target is not out
        _int4_mma_kernel[plan.grid(m, n)[:2]](
            x, packed, scale_zeros.view(torch.int32), bias if bias is not None else out, target, m, n, k,
            plan.k_per_split // 32, GROUP=group_size, BM=block_m, NB=nb, TK=tk, WARPS=warps,
            STAGES=stages, EVEN=n % block_n == 0 and k % block_k == 0, SPLIT=split, HAS_BIAS=bias is not None,
            WEIGHT_A=kind.weight_a, WGMMA=kind.wgmma, num_warps=warps)
        return reduce_splits(target, out, None, None, bias) if split else out

    if tile is not None:
        return launch((form, tile))
    forms = [form] if form else forms
    limit = shared_memory_limit(x.device)
    choices = [(f, t) for f in forms for t in tiles_that_fit(limit, block_m, group_size, FORMS[f].candidates)]
    default = (forms[0], FORMS[forms[0]].default)
    default = default if default in choices else choices[0]
    return launch(timed_tile(("int4_mma", n, k, group_size, block_m, tuple(forms), x.device), launch, choices, default))
