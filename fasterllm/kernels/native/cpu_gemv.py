"""The int4 and int8 CPU layers' matrix-vector products for decode rows, in C++ (cpu/*.cpp): torch's own kernels
read the weights at a fraction of the memory bandwidth (benchmarks/RESULTS.md, issue 27), and decode on a CPU is
a read of every weight per step.

The input rows are quantized to int8 per block of 32 (one fp32 scale each) and multiplied by the weight codes with
integer dot products (AVX2 maddubs, AVX-512 VNNI), each block's sum scaled in fp32. The ISA is chosen once from the
CPU's flags: "avx512" (avx512f/bw/dq/vl + avx512_vnni), else "avx2" (avx2/fma/f16c), else none. FASTERLLM_CPU_KERNELS
("avx512", "avx2" or "off") overrides it: tests and benchmarks force the AVX2 code on an AVX-512 machine so.

The extension builds with torch.utils.cpp_extension on first use (scripts/setup.sh builds it when a compiler is
present, ~20 s on 2 cores) into torch's extension cache, which rebuilds when a source changes. Without a compiler,
or if the build fails, one warning line says so and the layers keep torch's kernels.
"""
from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import NamedTuple

import torch

from fasterllm.cpu_features import cpu_flags

logger = logging.getLogger("fasterllm")

ISA_ENV = "FASTERLLM_CPU_KERNELS"
ISA_FLAGS = {"avx512": {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni", "avx2", "fma", "f16c"},
             "avx2": {"avx2", "fma", "f16c"}}
DECODE_ROWS = 8  # inputs of at most this many rows take these kernels; more rows keep torch's (GEMM-shaped) ones
BLOCK = 32  # weights per int4 group, activations per int8 block
TILE_ROWS = 16  # output rows per tile
SOURCES = ("ops.cpp", "quantize_rows.cpp", "gemv_avx2.cpp", "gemv_avx512.cpp")


def supported_isas() -> list[str]:
    """The ISAs of these kernels that this CPU runs, widest first."""
    flags = cpu_flags()
    return [isa for isa, needs in ISA_FLAGS.items() if needs <= flags]


class Int4Weights(NamedTuple):
    """pack_int4's result: codes [N/16, K/32, 256] uint8, scales and minimums [N/16, K/32, 16] fp32, rows N."""
    codes: torch.Tensor
    scales: torch.Tensor
    minimums: torch.Tensor
    rows: int


class Int8Weights(NamedTuple):
    """pack_int8's result: codes [N/16, K/32, 512] int8, scales [N/16, 16] fp32, rows N."""
    codes: torch.Tensor
    scales: torch.Tensor
    rows: int


@functools.cache
def kernel_isa() -> str | None:
    """The ISA the layers run ("avx512" or "avx2"), or None: no such CPU, or FASTERLLM_CPU_KERNELS=off."""
    supported = supported_isas()
    asked = os.environ.get(ISA_ENV, "").strip().lower()
    if not asked:
        return supported[0] if supported else None
    if asked == "off":
        return None
    if asked not in ISA_FLAGS:
        raise ValueError(f"{ISA_ENV}={asked!r} is not one of 'avx512', 'avx2', 'off'; unset it to choose by the "
                         "CPU's flags")
    if asked not in supported:
        missing = sorted(ISA_FLAGS[asked] - cpu_flags())
        raise ValueError(f"{ISA_ENV}={asked!r}, but this CPU lacks {', '.join(missing)}; use one of "
                         f"{supported + ['off']} or unset it")
    return asked


@functools.cache
def load() -> bool:
    """Build (first time) and load the extension; False, after one warning line, where that fails."""
    from torch.utils import cpp_extension

    source_dir = Path(__file__).parent / "cpu"
    try:
        # -fopenmp: at::parallel_for is OpenMP inside ATen's headers (torch's own libgomp at run time); without it
        # the output rows would run on one thread
        cpp_extension.load("fasterllm_cpu_kernels", [str(source_dir / name) for name in SOURCES],
                           extra_cflags=["-O3", "-fopenmp"], extra_ldflags=["-fopenmp"], is_python_module=False,
                           verbose=False)
    except Exception as error:  # no compiler, no ninja, a failed build: torch's kernels still run
        reason = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
        logger.warning("fasterllm's C++ CPU kernels could not be built (%s); the int4/int8 layers use torch's "
                       "slower kernels: install a C++ compiler (g++) and ninja for them", reason)
        return False
    return True


def available() -> bool:
    """Whether the layers can run these kernels here: a CPU with one of the ISAs, and the extension built."""
    return kernel_isa() is not None and load()


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
    """Codes uint8 [N, K] in 0..15 with fp32 scales and minimums [N, K/32] -> the kernels' tiles (cpu/gemv.h): per
    tile of 16 rows and block of 32, chunk c's byte 4r + j holds row r's codes at k = 8c + j (low nibble) and
    8c + 4 + j (high)."""
    rows, cols = codes.shape
    _check_width(cols)
    # [tile, row, block, chunk, nibble, j] -> [tile, block, chunk, row, j, nibble]
    split = _tiles(codes.to(torch.uint8)).reshape(-1, TILE_ROWS, cols // BLOCK, 4, 2, 4).permute(0, 2, 3, 1, 5, 4)
    packed = (split[..., 0] | (split[..., 1] << 4)).reshape(-1, cols // BLOCK, TILE_ROWS * BLOCK // 2)

    def by_tile(values: torch.Tensor) -> torch.Tensor:  # [N, K/32] -> [N/16, K/32, 16]
        return _tiles(values.float()).transpose(1, 2).contiguous()

    return Int4Weights(packed.contiguous(), by_tile(scales), by_tile(minimums), rows)


def pack_int8(weight: torch.Tensor, scales: torch.Tensor) -> Int8Weights:
    """int8 weight [N, K] in -127..127 with fp32 scales [N] -> the kernels' tiles (cpu/gemv.h): per tile of 16 rows
    and block of 32, chunk c's byte 4r + j holds row r's weight at k = 4c + j."""
    rows, cols = weight.shape
    _check_width(cols)
    # [tile, row, block, chunk, j] -> [tile, block, chunk, row, j]
    split = _tiles(weight.to(torch.int8)).reshape(-1, TILE_ROWS, cols // BLOCK, 8, 4).permute(0, 2, 3, 1, 4)
    return Int8Weights(split.reshape(-1, cols // BLOCK, TILE_ROWS * BLOCK).contiguous(),
                       _tiles(scales.float()).contiguous(), rows)


def int4_gemv(x: torch.Tensor, weights: Int4Weights, isa: str | None = None) -> torch.Tensor:
    """x [M, K] (fp32/bf16) @ w.T -> [M, N] fp32, w = code * scale + minimum per group of 32 (pack_int4's weights)."""
    return torch.ops.fasterllm_cpu.int4_gemv(x, weights.codes, weights.scales, weights.minimums, weights.rows,
                                             isa or kernel_isa())


def int8_gemv(x: torch.Tensor, weights: Int8Weights, isa: str | None = None) -> torch.Tensor:
    """x [M, K] (fp32/bf16) @ w.T -> [M, N] fp32, w = weight * scale per output row (pack_int8's weights)."""
    return torch.ops.fasterllm_cpu.int8_gemv(x, weights.codes, weights.scales, weights.rows, isa or kernel_isa())
