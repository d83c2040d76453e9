"""One row times an int8 weight with a scale per row (Gluon, NVIDIA GPUs): batch-1 decode's int8 products.

gemv.py's Triton kernel reads int8 weights at 1.8-2.1 TB/s on the 8B shape's small projections (o, qkv) where its
large ones reach 2.7-2.9: a launch's fixed start and tail (~4 us) weighs twice as much on int8's half-size reads as
on bf16's, and loading a chunk of weights before the PDL wait, which hides part of it, cost that kernel more
registers than it saved (benchmarks/RESULTS.md). Here the register layout is ours (Gluon), as in int4_gemv.py:

- bytes: the int8 layer's own [N, K] codes, read as int32 words; a thread loads one 16-code chunk (16 contiguous
  bytes) of R consecutive rows; a warp's lanes are RL row groups x 32 / RL consecutive chunks of each.
- x: a chunk's 16 bf16 values are 4 int64 words, 32 contiguous bytes, shared by the thread's R rows: word j of
  the codes (codes 4j .. 4j + 3) meets x's int64 word j, whose low int32 holds x[4j], x[4j + 1] and high one
  x[4j + 2], x[4j + 3].
- codes: one xor a word flips its four sign bits (code + 128), one prmt a code places its byte under the bits of
  2^23 (the float 2^23 + code + 128, exact), one add takes 2^23 + 128 away (exact), one fused multiply-add.
- each row's sum is scaled by its fp32 scale once, at the end.

The first step's weights are loaded before the PDL wait (no kernel writes them): the gain is in decode's chain of
launches, where it overlaps the kernel before; timed alone it is slower than gemv.py's kernel at three of the 8B
shapes (benchmarks/RESULTS.md), and it is used on Hopper and later only, where PDL is. Its tile (R, RL, warps) is
timed once per shape (tile_timer.py). Triton's interpreter cannot run Gluon: the CPU runs gemv.py's kernel; the GPU
tests run this one against it and against the dequantized product (tests/kernels/test_int8_gemv.py).
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from fasterllm.kernels.dependent_launch import early_launch
from fasterllm.kernels.gluon_parts import bf16_of_pair, early_start
from fasterllm.kernels.tile_timer import timed_tile

# (R rows a thread, RL row groups across a warp's lanes, num_warps)
CANDIDATES = [(1, 1, 4), (2, 1, 4), (4, 1, 4), (1, 1, 8), (2, 1, 8), (2, 4, 4), (4, 4, 4), (4, 2, 8)]
DEFAULT = (2, 1, 4)  # a shape timed nowhere (a graph capture's first call)


@gluon.jit
def _codes_as_floats(words):
    """The four int8 codes of each int32 word as floats 2^23 + code + 128, byte b the b-th."""
    return gl.inline_asm_elementwise(
        """{ .reg .b32 t, m; xor.b32 t, $4, 0x80808080; mov.b32 m, 0x4B000000;
        prmt.b32 $0, t, m, 0x7540; prmt.b32 $1, t, m, 0x7541;
        prmt.b32 $2, t, m, 0x7542; prmt.b32 $3, t, m, 0x7543; }""",
        "=r,=r,=r,=r,r", [words], dtype=(gl.float32, gl.float32, gl.float32, gl.float32), is_pure=True, pack=1)


@gluon.jit
def load_weight_chunk(w_ptr, w_offsets, row_mask3, chunk3, KC, c0):
    """The words [BR, C, 4] of the chunks from c0; chunks past K read as zeros (which add nothing). Weights only:
    no kernel writes them, so the first step's may be read before early_start (tests/kernels/
    test_dependent_launch.py allows this function there)."""
    return gl.load(w_ptr + w_offsets + c0 * 4, mask=row_mask3 & (c0 + chunk3 < KC), other=0)


@gluon.jit
def _load_x(x_ptr, x_offsets, x_chunk, KC, c0):
    """x's int64 words [C, 4] of the chunks from c0."""
    return gl.load(x_ptr + x_offsets + c0 * 4, mask=gl.expand_dims(c0 + x_chunk < KC, 1), other=0)


@gluon.jit
def _accumulate(acc, words, x):
    """acc [BR, C] plus each (row, chunk)'s 16 codes times x (2^23 + code + 128, less 2^23 + 128 = 8388736)."""
    low, high = x.to(gl.int32), (x >> 32).to(gl.int32)
    v0, v1, v2, v3 = _codes_as_floats(words)
    dots = (v0 - 8388736.0) * gl.expand_dims(bf16_of_pair(low, False), 0)
    dots += (v1 - 8388736.0) * gl.expand_dims(bf16_of_pair(low, True), 0)
    dots += (v2 - 8388736.0) * gl.expand_dims(bf16_of_pair(high, False), 0)
    dots += (v3 - 8388736.0) * gl.expand_dims(bf16_of_pair(high, True), 0)
    return acc + gl.sum(dots, axis=2)


@gluon.jit
def _int8_gemv_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, N, KC, row_chunks, R: gl.constexpr,
                      RL: gl.constexpr, WARPS: gl.constexpr, HAS_BIAS: gl.constexpr, PDL: gl.constexpr):
    # [BR rows, C chunks, 4 words]: a thread holds one chunk's 4 words of R rows
    L3: gl.constexpr = gl.BlockedLayout([R, 1, 4], [RL, 32 // RL, 1], [1, WARPS, 1], [2, 1, 0])
    L2: gl.constexpr = gl.SliceLayout(2, L3)  # [BR, C]
    LX: gl.constexpr = gl.SliceLayout(0, L3)  # [C, 4]
    BR: gl.constexpr = R * RL
    C: gl.constexpr = 32 // RL * WARPS
    row = gl.program_id(0) * BR + gl.arange(0, BR, layout=gl.SliceLayout(1, L2))
    chunk = gl.arange(0, C, layout=gl.SliceLayout(0, L2))
    word = gl.arange(0, 4, layout=gl.SliceLayout(0, LX))
    x_chunk = gl.arange(0, C, layout=gl.SliceLayout(1, LX))
    row3 = gl.expand_dims(gl.expand_dims(row, 1), 2)
    chunk3 = gl.expand_dims(gl.expand_dims(chunk, 0), 2)
    row_mask3 = row3 < N
    # a row's stride in 16-byte chunks, times 4 words: the compiler sees every row start 16-byte aligned (128-bit
    # loads) whatever the stride's own divisibility
    w_offsets = row3.to(gl.int64) * row_chunks * 4 + chunk3 * 4 + gl.expand_dims(gl.expand_dims(word, 0), 0)
    x_offsets = gl.expand_dims(x_chunk, 1) * 4 + gl.expand_dims(word, 0)
    acc = gl.zeros([BR, C], gl.float32, layout=L2)
    # no kernel writes the weights: their first loads are in flight before waiting for the kernel before
    words = load_weight_chunk(w_ptr, w_offsets, row_mask3, chunk3, KC, 0)
    early_start(PDL)
    x = _load_x(x_ptr, x_offsets, x_chunk, KC, 0)
    for c0 in range(0, KC, C):  # the next step's loads are in flight while this step's arithmetic runs
        next_words = load_weight_chunk(w_ptr, w_offsets, row_mask3, chunk3, KC, c0 + C)
        next_x = _load_x(x_ptr, x_offsets, x_chunk, KC, c0 + C)
        acc = _accumulate(acc, words, x)
        words, x = next_words, next_x
    out = gl.sum(acc, axis=1) * gl.load(scale_ptr + row, mask=row < N, other=0.0)
    if HAS_BIAS:
        out += gl.load(bias_ptr + row, mask=row < N, other=0.0).to(gl.float32)
    gl.store(out_ptr + row, out.to(out_ptr.dtype.element_ty), mask=row < N)


def fits(x: torch.Tensor, qweight: torch.Tensor) -> bool:
    """Whether this kernel reads these operands: one bf16 row, int8 codes, K a multiple of 16, rows and x aligned
    to 16 bytes (the words it loads); gemv.py's kernel takes the rest."""
    k = x.shape[-1]
    return (x.dtype == torch.bfloat16 and qweight.dtype == torch.int8 and x.numel() == k == qweight.shape[1]
            and k % 16 == 0 and qweight.stride(1) == 1 and qweight.stride(0) % 16 == 0 and x.is_contiguous()
            and x.data_ptr() % 16 == 0 and qweight.data_ptr() % 16 == 0)


def int8_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
              tile: tuple[int, int, int] | None = None) -> torch.Tensor:
    """x [1, K] bf16 times int8 codes [N, K] scaled by scales (fp32 [N]) per row -> [1, N] bf16 (fits() must hold).
    NVIDIA GPUs only. tile: one of CANDIDATES instead of the one timed fastest (tests, benchmarks)."""
    if not fits(x, qweight) or scales.dtype != torch.float32:
        raise ValueError(f"int8_gemv takes one bf16 row of K values (K a multiple of 16, 16-byte aligned) and int8 "
                         f"codes [N, K] with fp32 scales, got x {tuple(x.shape)} {x.dtype}, codes "
                         f"{tuple(qweight.shape)} {qweight.dtype}, scales {scales.dtype}")
    n, k = qweight.shape
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    words = qweight.view(torch.int32)
    x_words = x.view(torch.int64)

    def launch(config: tuple[int, int, int]) -> None:
        rows, lanes, warps = config
        _int8_gemv_kernel[(-(-n // (rows * lanes)),)](
            x_words, words, scales, bias if bias is not None else out, out, n, k // 16, qweight.stride(0) // 16,
            R=rows, RL=lanes, WARPS=warps, HAS_BIAS=bias is not None, num_warps=warps, **early_launch(x.device))

    launch(tile or timed_tile(("int8_gemv", n, k, x.device), launch, CANDIDATES, DEFAULT))
    return out
