"""Weight-only linear layers over 8-bit codes in groups: a code per weight (uint8, 0..255) and an fp32 scale and
minimum per group of consecutive inputs of a row, weight = code * scale + minimum, exact in fp32.

The layout GGUF's Q8_0, Q5_K and Q6_K blocks (and 4-bit codes fused with them) run as stored, without re-rounding
(loader/gguf_blocks.py unpacks them, layers/quantization/gguf.py holds them while loading):
  Q8_0  int8 q, fp16 d per 32        code q + 128, scale d, minimum -128 d                       groups of 32
  Q5_K  5-bit codes per 32           scale d * sc, minimum -dmin * m (sc, m 6-bit)             groups of 32
  Q6_K  6-bit codes per 16           scale d * sc (sc int8), minimum -32 scale                  groups of 16
Scales and minimums are given in fp32: d * sc of a Q5_K or Q6_K block needs up to 19 bits of mantissa, more than
fp16's or bf16's (our C++ kernel holds a layer's in fp16 where that holds every one exactly: Q8_0's). The group size
is a parameter of the layer (GROUP_SIZES, read off the scales' width), not one fixed 16 that would hold all three (a
32-group's scale repeated twice): the fp32 scale and minimum cost 8 bytes a group, 0.5 byte a weight at 16 against
0.25 at 32, on top of the 1-byte code, and decode reads all of it every step, so Q8_0 and Q5_K projections read 1.25
bytes a weight instead of 1.5 (a sixth less; Q8_0 1.125 with fp16 ones); only a projection with a Q6_K part takes
groups of 16. The kernels take any power-of-two group (the GPU ones, kernels/quant_weight_only.py, already
did for int4) or both sizes (the C++ ones).

Two CPU kernels, one chosen per layer at load, as int4.py's: our C++ one where it is built (unless
FASTERLLM_CPU_KERNELS=off; kernels/native/cpu_gemv.py: the codes in int8's tiles, turned into fp32 in registers and
multiplied by the inputs as they come with fp32 FMAs, each group's scale and minimum applied once to its sum: the
exact product up to fp32 summation), else the torch path below.

The torch path: each call dequantizes the weight to the activation dtype (fp32 products, one rounding to
x's dtype: exact in an fp32 run, as the float weight is) and multiplies with F.linear, a block of output rows at a
time into a reused fp32 workspace. Its cost: where a float fp32 matmul reads 4 bytes a weight, this reads 1.25-1.5
and makes four passes over each block (convert, multiply, add, matmul). Measured on a busy 2-core VM
(benchmarks/cpu_uint8_grouped.py, RESULTS.md): one row 1.0-1.7x F.linear over the float weight on 4096-wide
weights (both bound by memory) and 3-4x on SmolLM2's small ones (a few fixed-cost ops per block); 8-64 rows
1.0-1.5x. The C++ kernel was 7-11x faster than both at one row (and than torch's int8 kernel over the codes
re-rounded, what these types ran as before).
"""
from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from fasterllm.kernels.native import cpu_extension, cpu_gemv
from fasterllm.layers.linear import FlatLinear

GROUP_SIZES = (16, 32)
# dequantized weights per block of output rows (fp32): a decode's few rows reuse each block little, so it stays small
# (4 MiB: measured best of 1-64 MiB for one row on 576- to 4096-wide weights); more rows amortize the dequantization
# and run faster over fewer, larger matmuls (32 MiB)
_FEW_ROWS, _FEW_ROWS_BLOCK, _MANY_ROWS_BLOCK = 16, 1 << 20, 1 << 23
# one fp32 block a thread, reused by every layer (no allocation per call), kept at the largest size asked for: up to
# 32 MiB once a prefill ran
_workspaces = threading.local()


def dequantize_uint8_grouped(codes: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor,
                             out: torch.Tensor | None = None) -> torch.Tensor:
    """codes uint8 [N, K], scales and minimums [N, K / group] -> the fp32 weight [N, K], codes * scale + minimum
    (for GGUF's blocks exactly what gguf dequantizes: a code times a scale, an fp16 times an integer, is exact in
    fp32, and the one addition rounds as gguf's does), into out (fp32, N * K elements or more) if given."""
    n, k = codes.shape
    groups = scales.shape[1]
    weight = (torch.empty(n * k, device=codes.device) if out is None else out[:n * k]).view(n, groups, k // groups)
    weight.copy_(codes.view(n, groups, k // groups))
    weight.mul_(scales.float()[..., None]).add_(minimums.float()[..., None])
    return weight.view(n, k)


def check_grouped_codes(codes: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor) -> None:
    """Raise a ValueError naming the shapes unless codes are uint8 [N, K] with scales and minimums [N, K / group],
    group in GROUP_SIZES."""
    n, k = codes.shape
    group = k // max(1, scales.shape[-1])
    if (codes.dtype != torch.uint8 or group not in GROUP_SIZES or k % group
            or not scales.shape == minimums.shape == (n, k // group)):
        raise ValueError(f"uint8_grouped takes uint8 codes [N, K] and scales and minimums [N, K / group] with "
                         f"group one of {GROUP_SIZES}; got {codes.dtype} codes {tuple(codes.shape)}, scales "
                         f"{tuple(scales.shape)} and minimums {tuple(minimums.shape)}")


class Uint8GroupedLinear(FlatLinear):
    """Built from codes uint8 [N, K], fp32 scales and minimums [N, K / group] (group in GROUP_SIZES). native: run our
    C++ kernel (None: where it is on and built, cpu_extension.available(), and K is a multiple of 32);
    False keeps the torch path."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor, bias: torch.Tensor | None,
                 native: bool | None = None):
        super().__init__()
        check_grouped_codes(codes, scales, minimums)
        n, k = codes.shape
        self.out_features, self.group_size = n, k // scales.shape[1]
        fits = k % cpu_gemv.BLOCK == 0
        self.native = cpu_gemv.pack_uint8_grouped(codes, scales, minimums) if fits and (
            cpu_extension.available() if native is None else native) else None
        if self.native is None:
            self.codes = codes.contiguous()
            self.scales, self.minimums = scales.float().contiguous(), minimums.float().contiguous()
        self.bias = bias

    def rows_per_block(self, rows: int) -> int:
        """Output rows dequantized at a time for an input of this many rows."""
        n, k = self.codes.shape
        return min(n, max(1, (_FEW_ROWS_BLOCK if rows <= _FEW_ROWS else _MANY_ROWS_BLOCK) // k))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None:
            out = cpu_gemv.uint8_grouped_gemv(x, self.native)  # in x's dtype
            return out if self.bias is None else out + self.bias
        n, k = self.codes.shape
        step = self.rows_per_block(x.shape[0])
        workspace = getattr(_workspaces, "block", None)
        if workspace is None or workspace.numel() < step * k or workspace.device != x.device:
            with torch.inference_mode(False):  # an ordinary tensor: written in place in and out of inference mode
                workspace = _workspaces.block = torch.empty(step * k, device=x.device)
        out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
        for start in range(0, n, step):
            rows = slice(start, min(n, start + step))
            weight = dequantize_uint8_grouped(self.codes[rows], self.scales[rows], self.minimums[rows], workspace)
            out[:, rows] = F.linear(x, weight.to(x.dtype), None if self.bias is None else self.bias[rows])
        return out
