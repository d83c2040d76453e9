"""Quantized linear layers on an NVIDIA GPU: int8 / int4 weight-only, W8A8 and FP8, each built from a float weight,
and grouped 8-bit codes (a GGUF's Q8_0 / Q5_K / Q6_K blocks as stored).

  int8  Int8GPULinear   int8 weights per output channel, read and widened inside Triton kernels
                        (kernels/quant_weight_only.py: one row, 2-64 rows, prefill; one bf16 row on Hopper
                        and later: the Gluon kernel of kernels/int8_gemv.py)
  int4  Int4GPULinear   4-bit codes (groups of 32-256, scale + minimum, the CPU layer's and GGUF Q4_1's convention),
                        two per byte, dequantized inside the same kernels; bf16 layers (NVIDIA, 8.0+) keep
                        tinygemm's byte order and bf16 scale + zero, read by the Gluon kernels of
                        kernels/int4_gemv.py (one row) and int4_mma.py (2-64 rows)
  uint8_grouped  Uint8GroupedGPULinear  8-bit codes (0..255), one a byte, with a scale and minimum per group of 16
                        or 32 (uint8_grouped.py's layout), dequantized inside the same kernels
  w8a8  W8A8GPULinear   int8 weights per channel x int8 activations per token, int32 sums on the tensor cores,
                        dequantization in the GEMM's epilogue (kernels/quant_w8a8.py)
  fp8   FP8Linear       e4m3 weights per channel x e4m3 activations per token (Hopper, compute capability
                        9.0+; kernels/quant_fp8.py: torch._scaled_mm's row-wise scaling, decode rows
                        through our GEMM, as W8A8's)
The last two take their input quantized by the RMSNorm or SiLU*mul before them when the model has those fused
(fused_activation.py), and quantize it themselves (one Triton launch) otherwise.
Every forward launches only shape-dependent work (no host sync): the layers run inside the decode CUDA graphs.
"""
from __future__ import annotations

import torch

from fasterllm.kernels.quant_activation import quantize_per_token
from fasterllm.kernels.quant_fp8 import fp8_gemm
from fasterllm.kernels.quant_w8a8 import int8_gemm
from fasterllm.kernels.quant_weight_only import (pack_int4_codes, pack_int4_tinygemm, tinygemm_kernel_available,
                                                 tinygemm_matmul, weight_only_matmul)
from fasterllm.layers.linear import FlatLinear
from fasterllm.layers.quantization.experts import quantize_e4m3_per_channel
from fasterllm.layers.quantization.fused_activation import QuantizedRows
from fasterllm.layers.quantization.int4 import group_size_of, quantize_int4_grouped, scales_and_zeros
from fasterllm.layers.quantization.int8 import quantize_int8_per_channel
from fasterllm.layers.quantization.uint8_grouped import check_grouped_codes

_SCALED_MM_MULTIPLE = 16  # torch._scaled_mm: K and N must be multiples of 16 (M is free)


class Int8GPULinear(FlatLinear):
    """Built from int8 codes [N, K] and fp32 scales [N] (a checkpoint's, as stored) for a model run in dtype;
    from_float quantizes."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        self.out_features = qweight.shape[0]
        self.qweight, self.scales = qweight, scales.float()
        self.bias = None if bias is None else bias.to(dtype)  # F.linear (prefill) takes x's dtype only

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> Int8GPULinear:
        return cls(*quantize_int8_per_channel(weight), bias, weight.dtype)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return weight_only_matmul(x, self.qweight, self.scales, self.bias)


class Int4GPULinear(FlatLinear):
    """Built from codes uint8 [N, K] (0..15), per-group scales and minimums [N, K/group] (codes * scale + minimum,
    the CPU Int4WeightOnlyLinear's arguments; group one of HELD_GROUP_SIZES): quantized from a float weight by
    from_float (groups of 32), GGUF's Q4_0 / Q4_1 / Q4_K blocks (32), or a GPTQ / AWQ / W4A16 checkpoint's codes in
    its own groups (64-256: a quarter of the scale bytes of 32 at 128).
    A bf16 layer on an NVIDIA GPU of compute capability 8.0+ (out_features % 8 == 0) keeps tinygemm's layout, which
    our Gluon kernels read at 1-64 rows and torch's kernel reads too (tinygemm_matmul); others keep the row-major
    bytes and fp16 scales and minimums."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor,
                 bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        n, k = codes.shape
        self.out_features = n
        self.group_size = group_size_of(codes, scales)
        self.tinygemm = (dtype == torch.bfloat16 and n % 8 == 0 and k % 32 == 0
                         and tinygemm_kernel_available(codes.device))
        if self.tinygemm:  # qweight int32 [N/8, K/32, 32, 1], bf16 (scale, zero) [K/group, N, 2]; the codes kept
            self.qweight = pack_int4_tinygemm(codes)
            self.scale_zeros = scales_and_zeros(scales, minimums, dtype)
        else:
            self.qweight = pack_int4_codes(codes)
            self.scales, self.minimums = scales.half().contiguous(), minimums.half().contiguous()
        self.bias = None if bias is None else bias.to(dtype)

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> Int4GPULinear:
        return cls(*quantize_int4_grouped(weight), bias, weight.dtype)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.tinygemm:
            return tinygemm_matmul(x, self.qweight, self.scale_zeros, self.group_size, self.bias)
        return weight_only_matmul(x, self.qweight, self.scales, self.bias, self.minimums, self.group_size)


class Uint8GroupedGPULinear(FlatLinear):
    """Built from codes uint8 [N, K] (0..255), per-group scales and minimums [N, K/group] (codes * scale + minimum),
    the CPU Uint8GroupedLinear's arguments (a GGUF's Q8_0 / Q5_K / Q6_K blocks as stored). Scales and minimums are
    kept in fp16 where that holds every one exactly (Q8_0's d and -128 d), else in fp32 (Q5_K's and Q6_K's d * sc):
    no rounding either way. 1 row: gemv.py's kernel; 2-64: the split-K kernel; more: cuBLAS on a dequantized copy."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor,
                 bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        check_grouped_codes(codes, scales, minimums)
        self.out_features = codes.shape[0]
        self.qweight = codes.contiguous()
        self.group_size = codes.shape[1] // scales.shape[1]
        self.scales, self.minimums = _exact_half_or_float(scales), _exact_half_or_float(minimums)
        self.bias = None if bias is None else bias.to(dtype)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return weight_only_matmul(x, self.qweight, self.scales, self.bias, self.minimums, self.group_size,
                                  code_bits=8)


def _exact_half_or_float(values: torch.Tensor) -> torch.Tensor:
    """values in fp16 if each one survives the round trip (half the bytes a decode reads for them), else fp32."""
    half = values.half()
    return half.contiguous() if torch.equal(half.float(), values.float()) else values.float().contiguous()


class ActivationQuantizedLinear(FlatLinear):
    """A projection whose GEMM reads per-token quantized activations of activation_dtype: given as QuantizedRows
    by a fused producer, or float rows quantized here."""

    activation_dtype: torch.dtype

    def forward(self, x: torch.Tensor | QuantizedRows) -> torch.Tensor:
        if isinstance(x, QuantizedRows):
            return self.quantized_matmul(x.codes, x.scales, x.dtype)
        return super().forward(x)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return self.quantized_matmul(*quantize_per_token(x, self.activation_dtype), x.dtype)

    def quantized_matmul(self, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError


class W8A8GPULinear(ActivationQuantizedLinear, Int8GPULinear):
    """Int8GPULinear's int8 weights (its constructors), multiplied by int8 activations instead of widened."""

    activation_dtype = torch.int8

    def quantized_matmul(self, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return int8_gemm(codes, scales, self.qweight, self.scales, self.bias, dtype)


def check_fp8_device(device: torch.device) -> None:
    """fp8 needs torch._scaled_mm's row-wise scaling: an NVIDIA GPU of compute capability 9.0+ (Hopper)."""
    if device.type != "cuda":
        raise ValueError(f"quantization='fp8' needs an NVIDIA Hopper GPU (compute capability >= 9.0), not "
                         f"{device.type}; use 'int8', 'int4' or 'w8a8' there")
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        raise ValueError(f"quantization='fp8' needs compute capability >= 9.0 (Hopper) for torch._scaled_mm's "
                         f"row-wise scales; this GPU ({torch.cuda.get_device_name(device)}) is {major}.{minor}: use "
                         "'w8a8' or 'int8'")


class FP8Linear(ActivationQuantizedLinear):
    """Built from e4m3 codes [N, K] and fp32 scales [N] (a checkpoint's, as stored); from_float quantizes per
    output channel."""

    activation_dtype = torch.float8_e4m3fn

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        check_fp8_device(qweight.device)
        n, k = qweight.shape
        if n % _SCALED_MM_MULTIPLE or k % _SCALED_MM_MULTIPLE:
            raise ValueError(f"quantization='fp8' needs in and out features that are multiples of "
                             f"{_SCALED_MM_MULTIPLE} (torch._scaled_mm), got a [{n}, {k}] weight; use 'w8a8'")
        self.out_features = n
        self.qweight = qweight  # [N, K]: .t() is column-major
        self.scales = scales.float().reshape(1, n).contiguous()  # [1, N] fp32, the row-wise form
        self.bias = bias

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> FP8Linear:
        check_fp8_device(weight.device)
        return cls(*quantize_e4m3_per_channel(weight), bias)

    def quantized_matmul(self, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return fp8_gemm(codes, scales, self.qweight, self.scales, self.bias, dtype)  # scales [M, 1] fp32
