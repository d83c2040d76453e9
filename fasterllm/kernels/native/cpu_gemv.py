"""The int4, int8 and uint8_grouped CPU layers' matrix products, and fp32 layers' (layers/linear.TiledCPULinear), in
C++ (cpu/gemv*.cpp, built by cpu_extension.py): torch's own kernels read the weights at a fraction of the memory
bandwidth (benchmarks/RESULTS.md, issue 27; a decode step's fp32 products: oneDNN's at 16-19 GB/s of a 2-core AVX2
EPYC's 27.5, ours at 23-25, benchmarks/cpu_float_gemv.py), and decode on a CPU is a read of every weight per step.

The weights are repacked once into tiles of 16 output rows (cpu/gemv.h says the byte order). The input rows are
multiplied as they come (fp32, or bf16 widened to fp32, never rounded): the codes are turned into fp32 in registers
and multiplied by the inputs with fp32 FMAs (8 lanes on AVX2, 16 on AVX-512), each group's (int4, uint8_grouped) or
row's (int8) scale applied once to the sum; the output comes back in the input's dtype. With
FASTERLLM_CPU_INT4_INPUTS=int8 the int4 products quantize the input rows to int8 per block of 32 first and multiply
in integers (AVX2's byte multiply-adds), as llama.cpp does.
"""
from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch

from fasterllm.kernels.native.cpu_extension import kernel_isa

INT4_INPUTS_ENV = "FASTERLLM_CPU_INT4_INPUTS"

BLOCK = 32  # weights per int4 group, and the kernels' step along K
TILE_ROWS = 16  # output rows per tile


class Int4Weights(NamedTuple):
    """pack_int4's result: codes [N/16, K/32, 256] uint8, scales and minimums [N/16, K/32, 16] fp16 where every one
    of them is exact in fp16, else fp32, rows N."""
    codes: torch.Tensor
    scales: torch.Tensor
    minimums: torch.Tensor
    rows: int


class Int8Weights(NamedTuple):
    """pack_int8's result: codes [N/16, K/32, 512] int8, scales [N/16, 16] fp32, rows N."""
    codes: torch.Tensor
    scales: torch.Tensor
    rows: int


class FloatWeights(NamedTuple):
    """pack_float's result: weight [N/16, K/32, 512] fp32, rows N."""
    weight: torch.Tensor
    rows: int


class Uint8GroupedWeights(NamedTuple):
    """pack_uint8_grouped's result: codes [N/16, K/32, 512] uint8, scales and minimums [N/16, K/group, 16] fp16
    where every one of them is exact in fp16, else fp32, rows N."""
    codes: torch.Tensor
    scales: torch.Tensor
    minimums: torch.Tensor
    rows: int


def _tiles(values: torch.Tensor) -> torch.Tensor:
    """values [N, ...] -> [N/16 rounded up, 16, ...], padded with zero rows."""
    rows = values.shape[0]
    padded = values.new_zeros((-(-rows // TILE_ROWS) * TILE_ROWS, *values.shape[1:]))
    padded[:rows] = values
    return padded.reshape(-1, TILE_ROWS, *values.shape[1:])


def _check_width(cols: int) -> None:
    if cols % BLOCK:
        raise ValueError(f"the C++ CPU kernels need an input width divisible by {BLOCK}, got {cols}")


def pack_int4(codes: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor) -> Int4Weights:
    """Codes uint8 [N, K] in 0..15 with scales and minimums [N, K/32] -> the kernels' tiles (cpu/gemv.h): per
    tile of 16 rows and block of 32, chunk c's byte 4r + j holds row r's codes at k = 8c + 2j (low nibble) and
    8c + 2j + 1 (high). The scales and minimums are held in fp16 where fp16 holds every one of them exactly (GGUF
    Q4_0 / Q4_1's and symmetric GPTQ's: an fp16, or -8 times one; a decode step then reads a sixth fewer bytes),
    else in fp32 (Q4_K's and asymmetric GPTQ / AWQ's: an fp16 times a small integer; our own quantizer's): never
    rounded."""
    rows, cols = codes.shape
    _check_width(cols)
    # [tile, row, block, chunk, j, nibble] -> [tile, block, chunk, row, j, nibble]
    split = _tiles(codes.to(torch.uint8)).reshape(-1, TILE_ROWS, cols // BLOCK, 4, 4, 2).permute(0, 2, 3, 1, 4, 5)
    packed = (split[..., 0] | (split[..., 1] << 4)).reshape(-1, cols // BLOCK, TILE_ROWS * BLOCK // 2)
    return Int4Weights(packed.contiguous(), *_group_values_by_tile(scales, minimums), rows)


def _group_values_by_tile(scales: torch.Tensor, minimums: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group scales and minimums [N, groups] -> [N/16, groups, 16] each, as the kernels read a tile's: both in
    fp16 where fp16 holds every one of them exactly, else both in fp32 (never rounded)."""
    scales, minimums = (_tiles(values.float()).transpose(1, 2).contiguous() for values in (scales, minimums))
    if all(torch.equal(values.half().float(), values) for values in (scales, minimums)):
        return scales.half(), minimums.half()
    return scales, minimums


def _transposed_tiles(codes: torch.Tensor) -> torch.Tensor:
    """One value per weight [N, K] (one-byte codes, or fp32 weights) -> [N/16, K/32, 512]: per tile of 16 rows and
    block of 32, element 16j + r holds row r's value at k = j."""
    rows, cols = codes.shape
    _check_width(cols)
    # [tile, row, block, j] -> [tile, block, j, row]
    split = _tiles(codes).reshape(-1, TILE_ROWS, cols // BLOCK, BLOCK).permute(0, 2, 3, 1)
    return split.reshape(-1, cols // BLOCK, TILE_ROWS * BLOCK).contiguous()


def pack_int8(weight: torch.Tensor, scales: torch.Tensor) -> Int8Weights:
    """int8 weight [N, K] in -127..127 with fp32 scales [N] -> the kernels' tiles (cpu/gemv.h): per tile of 16 rows
    and block of 32, byte 16j + r holds row r's weight at k = j."""
    return Int8Weights(_transposed_tiles(weight.to(torch.int8)), _tiles(scales.float()).contiguous(), weight.shape[0])


def pack_float(weight: torch.Tensor) -> FloatWeights:
    """fp32 weight [N, K] -> the kernels' tiles (cpu/gemv.h): per tile of 16 rows and block of 32, float 16j + r
    holds row r's weight at k = j (the values as they are)."""
    return FloatWeights(_transposed_tiles(weight.detach().float()), weight.shape[0])


def pack_uint8_grouped(codes: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor) -> Uint8GroupedWeights:
    """Codes uint8 [N, K] (0..255) with scales and minimums [N, K/group] (group 16 or 32) -> the kernels' tiles
    (cpu/gemv.h): pack_int8's byte order, per tile and group 16 scales and 16 minimums. Those are held in fp16 where
    fp16 holds every one of them exactly (GGUF Q8_0's: d and -128 d; a decode step then reads a tenth fewer bytes),
    else in fp32 (Q5_K's and Q6_K's: an fp16 times a small integer): never rounded."""
    groups = scales.shape[1]
    if codes.shape[1] not in (16 * groups, 32 * groups):
        raise ValueError(f"the C++ CPU kernels take groups of 16 or 32 inputs, got {codes.shape[1]} inputs in "
                         f"{groups} groups")
    return Uint8GroupedWeights(_transposed_tiles(codes.to(torch.uint8)), *_group_values_by_tile(scales, minimums),
                               codes.shape[0])


@functools.cache
def int4_int8_inputs() -> bool:
    """Whether the int4 layers quantize their inputs to int8 per block of 32 (FASTERLLM_CPU_INT4_INPUTS=int8, as
    llama.cpp does on a CPU: byte multiply-adds instead of a conversion and an FMA per weight; SmolLM2's
    perplexity moved by -0.1% / +0.2% (int4 / gguf) from the fp32 inputs', benchmarks/RESULTS.md) rather than
    multiply them as they come (unset or "fp32": the exact product of the quantized weights)."""
    asked = os.environ.get(INT4_INPUTS_ENV, "").strip().lower() or "fp32"
    if asked not in ("fp32", "int8"):
        raise ValueError(f"{INT4_INPUTS_ENV}={asked!r} is not 'fp32' (the default: inputs as they come) or 'int8' "
                         "(inputs quantized per block of 32, faster)")
    return asked == "int8"


def int4_gemv(x: torch.Tensor, weights: Int4Weights, isa: str | None = None, int8_inputs: bool = False
              ) -> torch.Tensor:
    """x [M, K] (fp32/bf16) @ w.T -> [M, N] fp32, w = code * scale + minimum per group of 32 (pack_int4's weights).
    int8_inputs: x quantized to int8 per block of 32 first (quantize_rows_int8), the products in integers (AVX2)."""
    return torch.ops.fasterllm_cpu.int4_gemv(x, weights.codes, weights.scales, weights.minimums, weights.rows,
                                             isa or kernel_isa(), int8_inputs)


def quantize_rows_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 inputs int4_gemv(int8_inputs=True) multiplies, in torch (the reference): x [M, K] fp32 -> values
    [M, K] int8 in k order and scales [M, K/32], x ~= value * scale per block of 32; max |x| / 127 the scale."""
    blocks = x.float().reshape(x.shape[0], -1, BLOCK)
    largest = blocks.abs().amax(dim=-1, keepdim=True)
    # a true fp32 division, as the kernel's (127 / tensor is 127 x its reciprocal: another rounding)
    inverse = torch.where(largest > 0, torch.full_like(largest, 127) / largest, torch.zeros_like(largest))
    values = torch.round(blocks * inverse).to(torch.int8).reshape(x.shape)
    return values, (largest / 127).squeeze(-1)


def int8_gemv(x: torch.Tensor, weights: Int8Weights, isa: str | None = None) -> torch.Tensor:
    """x [M, K] (fp32/bf16) @ w.T -> [M, N] fp32, w = weight * scale per output row (pack_int8's weights)."""
    return torch.ops.fasterllm_cpu.int8_gemv(x, weights.codes, weights.scales, weights.rows, isa or kernel_isa())


def float_gemv(x: torch.Tensor, weights: FloatWeights, bias: torch.Tensor | None = None, isa: str | None = None
               ) -> torch.Tensor:
    """x [M, K] fp32 @ w.T (+ bias) -> [M, N] fp32 (pack_float's weights), each sum in fp32 FMAs along k."""
    return torch.ops.fasterllm_cpu.float_gemv(x, weights.weight, bias, weights.rows, isa or kernel_isa())


def uint8_grouped_gemv(x: torch.Tensor, weights: Uint8GroupedWeights, isa: str | None = None) -> torch.Tensor:
    """x [M, K] (fp32/bf16) @ w.T -> [M, N] in x's dtype, w = code * scale + minimum per group (pack_uint8_grouped's
    weights)."""
    return torch.ops.fasterllm_cpu.uint8_grouped_gemv(x, weights.codes, weights.scales, weights.minimums, weights.rows,
                                                      isa or kernel_isa())
