"""Weight-only linear layers over 8-bit codes in groups: a code per weight (uint8, 0..255) and an fp32 scale and
minimum per group of consecutive inputs of a row, weight = code * scale + minimum, exact in fp32.

The layout GGUF's Q8_0, Q5_K and Q6_K blocks (and 4-bit codes fused with them) run as stored, without re-rounding
(loader/gguf_blocks.py unpacks them, layers/quantization/gguf.py holds them while loading):
  Q8_0  int8 q, fp16 d per 32        code q + 128, scale d, minimum -128 d                       groups of 32
  Q5_K  5-bit codes per 32           scale d * sc, minimum -dmin * m (sc, m 6-bit)             groups of 32
  Q6_K  6-bit codes per 16           scale d * sc (sc int8), minimum -32 scale                  groups of 16
Scales and minimums stay fp32: d * sc of a Q5_K or Q6_K block needs up to 19 bits of mantissa, more than fp16's or
bf16's. The group size is a parameter of the layer (GROUP_SIZES, read off the scales' width), not one fixed 16
that would hold all three (a 32-group's scale repeated twice): the fp32 scale and minimum cost 8 bytes a group,
0.5 byte a weight at 16 against 0.25 at 32, on top of the 1-byte code, and decode reads all of it every step, so
Q8_0 and Q5_K projections read 1.25 bytes a weight instead of 1.5 (a sixth less); only a projection with a Q6_K part
takes groups of 16. The kernels take any power-of-two group (the GPU ones, kernels/quant_weight_only.py, already
did for int4).

The CPU kernel is torch's: each call dequantizes the weight to the activation dtype (fp32 products, one rounding to
x's dtype: exact in an fp32 run, as the float weight is) and multiplies with F.linear, a block of output rows at a
time into a reused 1 MiB fp32 block that stays in cache. Its cost: where a float fp32 matmul reads 4 bytes a weight,
this reads 1.25-1.5 and writes and reads back 4 in cache, plus a convert, a multiply and an add per weight, which
dominate: one-row decode measured about 2x F.linear over the float weight (a [4096, 2048] fp32 weight: 3.6 ms
against 1.7 ms on this 2-core VM), 64 rows 1.5-1.8x, 512 rows 1.1-1.2x. Our C++ kernels (FASTERLLM_CPU_KERNELS)
do not read these codes yet.
"""
from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from fasterllm.layers.linear import FlatLinear

GROUP_SIZES = (16, 32)
_BLOCK_ELEMENTS = 1 << 18  # dequantized weights per block of output rows: 1 MiB in fp32, fits a core's L2
_workspaces = threading.local()  # one fp32 block a thread, reused by every layer: no allocation per call


def dequantize_uint8_grouped(codes: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor,
                             out: torch.Tensor | None = None) -> torch.Tensor:
    """codes uint8 [N, K], scales and minimums [N, K / group] -> the fp32 weight [N, K], codes * scale + minimum
    (exact: the code times the scale is, and the one addition rounds as GGUF's own dequantize does), into out
    (fp32, N * K elements or more) if given."""
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
    """Built from codes uint8 [N, K], fp32 scales and minimums [N, K / group] (group in GROUP_SIZES)."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        check_grouped_codes(codes, scales, minimums)
        n, k = codes.shape
        self.out_features = n
        self.codes = codes.contiguous()
        self.scales, self.minimums = scales.float().contiguous(), minimums.float().contiguous()
        self.bias = bias
        self.rows_per_block = max(1, _BLOCK_ELEMENTS // k)

    @property
    def group_size(self) -> int:
        return self.codes.shape[1] // self.scales.shape[1]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        n, k = self.codes.shape
        step = self.rows_per_block
        workspace = getattr(_workspaces, "block", None)
        if workspace is None or workspace.numel() < step * k or workspace.device != x.device:
            with torch.inference_mode(False):  # an ordinary tensor: written in place in and out of inference mode
                workspace = _workspaces.block = torch.empty(max(_BLOCK_ELEMENTS, step * k), device=x.device)
        out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
        for start in range(0, n, step):
            rows = slice(start, min(n, start + step))
            weight = dequantize_uint8_grouped(self.codes[rows], self.scales[rows], self.minimums[rows], workspace)
            out[:, rows] = F.linear(x, weight.to(x.dtype), None if self.bias is None else self.bias[rows])
        return out
