"""Weight-only INT4 linear layers: asymmetric 4-bit codes in groups of 32 along the input dimension.

Each group of 32 weights of a row keeps a scale and a minimum (w ~= code * scale + minimum, codes 0..15). Groups
of 32 match GGUF's Q4_0/Q4_1 blocks, so those repack into this layer without rounding the codes
(layers/quantization/gguf.py), and 32 divides every SmolLM2 width (576 is not a multiple of 128). A pre-quantized
checkpoint's wider groups (GPTQ / AWQ / W4A16 groups of 64-256, or whole rows) are kept as wide as HELD_GROUP_SIZES
allow (held_group_size): the GPU layer reads fewer scale bytes then; this CPU layer repeats each scale over groups of
32 (its kernels' one width).

Two kernels, one chosen per layer at load: our C++ one where it is built (unless FASTERLLM_CPU_KERNELS=off)
(kernels/native/cpu_gemv.py: the inputs multiplied as they come with fp32 FMAs, faster than torch's at 1 to 128 rows
and more accurate: benchmarks/RESULTS.md; with FASTERLLM_CPU_INT4_INPUTS=int8 the inputs quantized to int8 first),
else torch's packed `_weight_int4pack_mm_for_cpu` (its layout: (code - 8) * scale + zero), which takes bf16
activations whatever the model's dtype (as int8.py's kernel).
"""
from __future__ import annotations

import torch

from fasterllm.kernels.native import cpu_extension, cpu_gemv
from fasterllm.layers.linear import FlatLinear
from fasterllm.layers.quantization.int8 import PACKED_KERNEL_DTYPE

GROUP_SIZE = 32
# the group widths a layer holds: every tinygemm kernel (torch's and ours) reads these
HELD_GROUP_SIZES = (32, 64, 128, 256)


def held_group_size(group_size: int, inputs: int, checkpoint: str = "pre-quantized") -> int:
    """The widest of HELD_GROUP_SIZES that a checkpoint's groups of group_size inputs (<= 0: one group a row of
    inputs) split into, so its scales repeat over held groups with no rounding (the loaders check that group_size is
    a multiple of 32); a group that does not divide the projection's inputs is a ValueError naming both and the
    checkpoint (its kind, for the message)."""
    if group_size > 0 and inputs % group_size:
        raise ValueError(f"a {checkpoint} checkpoint of group_size={group_size} cannot hold a projection of {inputs} "
                         "inputs (not a multiple of it); the checkpoint and its quantization_config disagree, or "
                         "(load_format='dummy') the config does not fit this model's widths")
    if group_size <= 0 and inputs % GROUP_SIZE:
        raise ValueError(f"a projection of {inputs} inputs quantized per row (group_size {group_size}) cannot run as "
                         f"int4 codes: the int4 layer holds groups of a multiple of {GROUP_SIZE} inputs and "
                         f"{inputs} is not one; run a float checkpoint of this model with quantization='int8'")
    group = inputs if group_size <= 0 else group_size
    return max(held for held in HELD_GROUP_SIZES if group % held == 0)


def group_size_of(codes: torch.Tensor, scales: torch.Tensor) -> int:
    """The group width of a layer's codes [N, K] and scales [N, K / group], checked to be one of HELD_GROUP_SIZES."""
    k, groups = codes.shape[1], scales.shape[1]
    group = k // groups if groups else 0
    if group not in HELD_GROUP_SIZES or group * groups != k or scales.shape[0] != codes.shape[0]:
        raise ValueError(f"int4 codes {tuple(codes.shape)} need scales [{codes.shape[0]}, {k} / group] with group one "
                         f"of {HELD_GROUP_SIZES}, got {tuple(scales.shape)}; repeat wider groups' scales "
                         "(repeat_groups)")
    return group


def repeat_groups(values: torch.Tensor, group: int, held: int = GROUP_SIZE) -> torch.Tensor:
    """Per-group values [N, K / group] -> [N, K / held] (held divides group), each repeated over the held groups it
    covers."""
    return values if group == held else values.repeat_interleave(group // held, dim=1).contiguous()


def quantize_int4_grouped(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (codes uint8 [N, K] in 0..15, fp32 scales [N, K/32], fp32 minimums [N, K/32])
    with weight ~= codes * scale + minimum per group (min/max rounding, as GGUF's Q4_1)."""
    rows, cols = weight.shape
    if cols % GROUP_SIZE:
        raise ValueError(f"int4 needs an input width divisible by the group size {GROUP_SIZE}, got {cols}; "
                         "use quantization='int8' for this model")
    groups = weight.float().reshape(rows, cols // GROUP_SIZE, GROUP_SIZE)
    low, high = groups.amin(dim=2), groups.amax(dim=2)
    scales = ((high - low) / 15).clamp(min=1e-12)
    codes = torch.round((groups - low[..., None]) / scales[..., None]).clamp(0, 15)
    return codes.reshape(rows, cols).to(torch.uint8), scales, low


def scales_and_zeros(scales: torch.Tensor, minimums: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per-group scales and minimums [N, G] -> [G, N, 2] (scale, zero) in dtype, torch's packed int4 kernels' form
    (CPU and CUDA): they centre codes at 8, codes * s + m == (codes - 8) * s + (m + 8 s)."""
    zeros = minimums.float() + 8 * scales.float()
    return torch.stack([scales.float(), zeros], dim=-1).transpose(0, 1).contiguous().to(dtype)


class Int4WeightOnlyLinear(FlatLinear):
    """Built from codes, per-group scales and minimums (codes * scale + minimum; groups of HELD_GROUP_SIZES, run as
    groups of 32): quantized from a float weight by from_float, or repacked from GGUF blocks or a pre-quantized
    checkpoint. native: run our C++ kernel (None: where it is on and built, cpu_extension.available()); False keeps
    torch's."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor,
                 bias: torch.Tensor | None, native: bool | None = None):
        super().__init__()
        self.out_features = codes.shape[0]
        group = group_size_of(codes, scales)
        scales, minimums = repeat_groups(scales, group), repeat_groups(minimums, group)
        self.native = cpu_gemv.pack_int4(codes, scales, minimums) if (
            cpu_extension.available() if native is None else native) else None
        if self.native is None:
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
            self.scales_and_zeros = scales_and_zeros(scales, minimums, PACKED_KERNEL_DTYPE)
        self.bias = bias

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> Int4WeightOnlyLinear:
        return cls(*quantize_int4_grouped(weight), bias)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None:
            out = cpu_gemv.int4_gemv(x, self.native, int8_inputs=cpu_gemv.int4_int8_inputs())  # in x's dtype
        else:
            out = torch._weight_int4pack_mm_for_cpu(x.to(PACKED_KERNEL_DTYPE), self.packed, GROUP_SIZE,
                                                    self.scales_and_zeros).to(x.dtype)
        return out if self.bias is None else out + self.bias
