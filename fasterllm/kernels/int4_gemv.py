"""One row times an int4 weight in tinygemm's layout (Gluon, NVIDIA GPUs): batch-1 decode's 4-bit products.

A 4-bit matrix-vector product reads half a byte a weight, so the GPU must widen each code, multiply and add in a
few instructions or the arithmetic, not the memory, bounds it: Triton's `tl` kernels took ~8 instructions a weight
(shared-memory shuffles of x and of the codes between layouts it chose) and torch's tensor-core kernel for these
bytes (`torch._weight_int4pack_mm`, gpt-fast's "tinygemm") reads them at 2.1-2.4x bf16's speed where 3.2x is the
byte ratio (benchmarks/RESULTS.md). Gluon fixes the register layout instead of letting Triton choose it, so a
thread keeps its codes and the x they meet in its own registers:

- bytes: pack_int4_tinygemm's (quant_weight_only.py), the layer's only copy: int32 [N/8, K/32, 32], in each block
  of 8 rows and tile of 32 k a row's 4 words (16 bytes) together, word j holding k = 2j + p // 4 + 8 (p % 4) in its
  nibble p. A thread loads one tile's 16 bytes of R rows (R blocks apart); a warp's 32 threads are 8 rows x 4
  consecutive tiles, 512 contiguous bytes a load.
- x: for p < 4, the pairs (x[2j + 8p], x[2j + 8p + 1]) of words j = 0..3 are 16 contiguous bytes of bf16: one
  load gives the x of nibbles p and p + 4 of the thread's 4 words, widened by a shift or a mask, shared by its R
  rows.
- codes: one lop3 ((w & mask) | magic) turns the nibble at bits 12-15 into the float 16 + q / 128 and the one at
  bits 16-19 into 1 + q / 128 (the magic's exponent puts both at the same scale); four shifts of the word bring
  its other nibbles there. One fused multiply-add a weight then sums (c + q / 128) x, and
  sum q x = 128 (sum (c + q / 128) x - sum c x), the second sum shared by every row of the thread.
- each (row, tile) adds 128 s (that) + (z - 8 s) sum x: tinygemm's weight is (q - 8) s + z, s and z bf16 per
  group of 32-256 k.

About 3.4-3.7 instructions a weight (sm_90 SASS, R = 4-8). Launched with PDL where the GPU has it
(dependent_launch.py). Its tile (R, warps) is timed once per shape (tile_timer.py). Triton's interpreter cannot run
Gluon: CI tests the layout and the arithmetic above in torch (tests/kernels/test_int4_gemv.py), the GPU tests run
the kernel against tinygemm_reference.
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from fasterllm.kernels.dependent_launch import early_launch
from fasterllm.kernels.gluon_parts import bf16_of_pair, early_start
from fasterllm.kernels.tile_timer import timed_tile

# (R rows a thread, num_warps), each the fastest at one of the 8B projections on an H100 (RESULTS.md): tile_timer's
# candidates
CANDIDATES = [(1, 8), (2, 4), (2, 8), (4, 4), (4, 8)]
DEFAULT = (2, 4)  # a shape timed nowhere (a graph capture's first call)


@gluon.jit
def _nibble_values(words, SHIFT: gl.constexpr, HIGH: gl.constexpr):
    """The nibble at bits 16-19 (HIGH) or 12-15 of words << SHIFT (>> -SHIFT) as the float 1 + q / 128 or
    16 + q / 128: one lop3 ((w & mask) | magic)."""
    if SHIFT > 0:
        words = words << SHIFT
    elif SHIFT < 0:
        words = words >> (-SHIFT)
    if HIGH:
        return gl.inline_asm_elementwise("lop3.b32 $0, $1, 0xF0000, 0x3F800000, 0xEA;", "=r,r", [words],
                                         dtype=gl.float32, is_pure=True, pack=1)
    return gl.inline_asm_elementwise("lop3.b32 $0, $1, 0xF000, 0x41800000, 0xEA;", "=r,r", [words],
                                     dtype=gl.float32, is_pure=True, pack=1)


@gluon.jit
def _rows_tiles(v):
    """[T, 4] -> [1, 1, T, 4]: x's values against every row."""
    return gl.expand_dims(gl.expand_dims(v, 0), 0)


@gluon.jit
def load_weight_chunk(w_ptr, sz_ptr, w_offsets, n_mask4, tile3, tile4, n3, N, KT, t0, TILES_PER_GROUP: gl.constexpr):
    """The words [R, 8, T, 4] and (scale, zero) pairs [R, 8, T] of the tiles from t0; tiles past K read as zeros
    (which add nothing). Weights only: no kernel writes them, so the first step's may be read before
    early_start (tests/kernels/test_dependent_launch.py allows this function there)."""
    words = gl.load(w_ptr + w_offsets + t0 * 32, mask=n_mask4 & (t0 + tile4 < KT), other=0)
    pairs = gl.load(sz_ptr + ((t0 + tile3) // TILES_PER_GROUP) * N + n3, mask=(n3 < N) & (t0 + tile3 < KT), other=0)
    return words, pairs


@gluon.jit
def _load_x(x_ptr, x_offsets, x_tile, KT, t0):
    """x's four bf16 pairs [T, 4] of each word of the tiles from t0."""
    x_mask = gl.expand_dims(t0 + x_tile < KT, 1)
    x0 = gl.load(x_ptr + x_offsets + t0 * 16, mask=x_mask, other=0)
    x1 = gl.load(x_ptr + x_offsets + (t0 * 16 + 4), mask=x_mask, other=0)
    x2 = gl.load(x_ptr + x_offsets + (t0 * 16 + 8), mask=x_mask, other=0)
    x3 = gl.load(x_ptr + x_offsets + (t0 * 16 + 12), mask=x_mask, other=0)
    return x0, x1, x2, x3


@gluon.jit
def _load_step(x_ptr, w_ptr, sz_ptr, w_offsets, n_mask4, x_offsets, x_tile, tile3, tile4, n3, N, KT, t0,
               TILES_PER_GROUP: gl.constexpr):
    """One step's loads: the weights' and x's of the tiles from t0."""
    words, pairs = load_weight_chunk(w_ptr, sz_ptr, w_offsets, n_mask4, tile3, tile4, n3, N, KT, t0, TILES_PER_GROUP)
    x0, x1, x2, x3 = _load_x(x_ptr, x_offsets, x_tile, KT, t0)
    return words, x0, x1, x2, x3, pairs


@gluon.jit
def _accumulate(acc, step):
    """acc [R, 8, T] plus one step's products: each (row, tile) adds its 32 weights times x."""
    words, x0, x1, x2, x3, pairs = step
    low0, low1, low2, low3 = (bf16_of_pair(x0, False), bf16_of_pair(x1, False), bf16_of_pair(x2, False),
                              bf16_of_pair(x3, False))
    high0, high1, high2, high3 = (bf16_of_pair(x0, True), bf16_of_pair(x1, True), bf16_of_pair(x2, True),
                                  bf16_of_pair(x3, True))
    # nibble p meets the low bf16 of pair p (p < 4) or the high one of pair p - 4; nibbles 0, 3, 5 become
    # 16 + q / 128, the others 1 + q / 128
    dots = _nibble_values(words, 12, False) * _rows_tiles(low0)
    dots += _nibble_values(words, 12, True) * _rows_tiles(low1)
    dots += _nibble_values(words, 8, True) * _rows_tiles(low2)
    dots += _nibble_values(words, 0, False) * _rows_tiles(low3)
    dots += _nibble_values(words, 0, True) * _rows_tiles(high0)
    dots += _nibble_values(words, -8, False) * _rows_tiles(high1)
    dots += _nibble_values(words, -8, True) * _rows_tiles(high2)
    dots += _nibble_values(words, -12, True) * _rows_tiles(high3)
    ones = low1 + low2 + high0 + high2 + high3
    sixteens = low0 + low3 + high1
    x_sums = gl.sum(_rows_tiles(ones + sixteens), axis=3)  # [1, 1, T]
    offsets = gl.sum(_rows_tiles(ones + 16.0 * sixteens), axis=3)
    scale, zero = bf16_of_pair(pairs, False), bf16_of_pair(pairs, True)
    # sum ((q - 8) s + z) x = 128 s (sum (c + q / 128) x - sum c x) + (z - 8 s) sum x
    return acc + (128.0 * scale) * (gl.sum(dots, axis=3) - offsets) + (zero - 8.0 * scale) * x_sums


@gluon.jit
def _int4_gemv_kernel(x_ptr, w_ptr, sz_ptr, bias_ptr, out_ptr, N, KT, GROUP: gl.constexpr, R: gl.constexpr,
                      WARPS: gl.constexpr, HAS_BIAS: gl.constexpr, PDL: gl.constexpr):
    # [R blocks, 8 rows, T tiles, 4 words]: a thread holds one tile's 4 words of R rows
    L4: gl.constexpr = gl.BlockedLayout([R, 1, 1, 4], [1, 8, 4, 1], [1, 1, WARPS, 1], [3, 1, 2, 0])
    L3: gl.constexpr = gl.SliceLayout(3, L4)  # [R, 8, T]
    L2: gl.constexpr = gl.SliceLayout(2, L3)  # [R, 8]
    LX: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(0, L4))  # [T, 4]
    T: gl.constexpr = 4 * WARPS
    TILES_PER_GROUP: gl.constexpr = GROUP // 32
    block = gl.program_id(0) * R + gl.arange(0, R, layout=gl.SliceLayout(1, L2))
    row = gl.arange(0, 8, layout=gl.SliceLayout(0, L2))
    tile = gl.arange(0, T, layout=gl.SliceLayout(0, gl.SliceLayout(0, L3)))
    x_tile = gl.arange(0, T, layout=gl.SliceLayout(1, LX))
    word = gl.arange(0, 4, layout=gl.SliceLayout(0, LX))
    n2 = gl.expand_dims(block, 1) * 8 + gl.expand_dims(row, 0)  # [R, 8] output columns
    n3 = gl.expand_dims(n2, 2)
    tile3 = gl.expand_dims(gl.expand_dims(tile, 0), 0)  # [1, 1, T]
    tile4 = gl.expand_dims(tile3, 3)
    # word (b * KT + t) * 32 + r * 4 + j of the [N/8, K/32, 32] words
    w_offsets = (gl.expand_dims(gl.expand_dims(gl.expand_dims(block, 1) * (KT * 32) + gl.expand_dims(row, 0) * 4, 2), 3)
                 + tile4 * 32 + _rows_tiles(gl.expand_dims(word, 0)))
    n_mask4 = gl.expand_dims(n3 < N, 3)
    x_offsets = gl.expand_dims(x_tile, 1) * 16 + gl.expand_dims(word, 0)  # [T, 4]: x's bf16 pair 2j of p = 0
    acc = gl.zeros([R, 8, T], gl.float32, layout=L3)
    # no kernel writes the weights: their first loads are in flight before waiting for the kernel before
    words, pairs = load_weight_chunk(w_ptr, sz_ptr, w_offsets, n_mask4, tile3, tile4, n3, N, KT, 0, TILES_PER_GROUP)
    early_start(PDL)
    x0, x1, x2, x3 = _load_x(x_ptr, x_offsets, x_tile, KT, 0)
    step = (words, x0, x1, x2, x3, pairs)
    for t0 in range(0, KT, T):  # the next step's loads are in flight while this step's arithmetic runs
        following = _load_step(x_ptr, w_ptr, sz_ptr, w_offsets, n_mask4, x_offsets, x_tile, tile3, tile4, n3, N, KT,
                               t0 + T, TILES_PER_GROUP)
        acc = _accumulate(acc, step)
        step = following
    out = gl.sum(acc, axis=2)
    if HAS_BIAS:
        out += gl.load(bias_ptr + n2, mask=n2 < N, other=0.0).to(gl.float32)
    gl.store(out_ptr + n2, out.to(out_ptr.dtype.element_ty), mask=n2 < N)


def int4_gemv(x: torch.Tensor, packed: torch.Tensor, scale_zeros: torch.Tensor, group_size: int,
              bias: torch.Tensor | None = None, tile: tuple[int, int] | None = None) -> torch.Tensor:
    """x [1, K] bf16 (contiguous) times the int4 weight pack_int4_tinygemm made (int32 [N/8, K/32, 32, 1];
    scale_zeros bf16 [K/group, N, 2], group_size a multiple of 32) -> [1, N] bf16. NVIDIA GPUs only. tile: one of
    CANDIDATES instead of the one timed fastest (tests, benchmarks)."""
    k = x.shape[-1]
    n = packed.shape[0] * 8
    if x.numel() != k or packed.shape[1] * 32 != k or x.dtype != torch.bfloat16 or group_size % 32:
        raise ValueError(f"int4_gemv takes one bf16 row of K values and tinygemm's [N/8, K/32, 32, 1] words with "
                         f"groups of a multiple of 32, got x {tuple(x.shape)} {x.dtype}, words {tuple(packed.shape)}, "
                         f"group {group_size}")
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    x_pairs = x.view(torch.int32)
    pairs = scale_zeros.view(torch.int32)

    def launch(config: tuple[int, int]) -> None:
        rows, warps = config
        _int4_gemv_kernel[(-(-n // (8 * rows)),)](
            x_pairs, packed, pairs, bias if bias is not None else out, out, n, k // 32, GROUP=group_size, R=rows,
            WARPS=warps, HAS_BIAS=bias is not None, num_warps=warps, **early_launch(x.device))

    launch(tile or timed_tile(("int4_gemv", n, k, group_size, x.device), launch, CANDIDATES, DEFAULT))
    return out
