"""A mixture of experts' stacked weights as codes with a scale per output channel (quantize_model, EXPERT_CODES):
int8 as the int8 layer quantizes a weight (int8.py), e4m3 by quantize_e4m3_per_channel (FP8Linear's too); one expert at
a time, since an fp32 copy of all of them would not fit beside the model."""
from __future__ import annotations

import torch

from fasterllm.layers.kv_cache_dtype import FP8_MAX
from fasterllm.layers.quantization.int8 import quantize_int8_per_channel


def quantize_e4m3_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (e4m3 [N, K], fp32 scales [N]) with weight ~= e4m3 * scale[:, None] (FP8Linear's too)."""
    w = weight.float()
    scales = w.abs().amax(dim=1).clamp(min=1e-12) / FP8_MAX
    # the absmax's own quotient can round just past FP8_MAX
    return (w / scales[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scales


def quantize_stacked(weight: torch.Tensor, codes_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked weights [E, N, K] -> (codes [E, N, K] of codes_dtype, fp32 scales [E, N]), symmetric per output
    channel."""
    quantize = {torch.int8: quantize_int8_per_channel, torch.float8_e4m3fn: quantize_e4m3_per_channel}.get(codes_dtype)
    if quantize is None:
        raise ValueError(f"experts quantize to torch.int8 or torch.float8_e4m3fn, not {codes_dtype}")
    codes = torch.empty(weight.shape, dtype=codes_dtype, device=weight.device)
    scales = torch.empty(weight.shape[:2], dtype=torch.float32, device=weight.device)
    for expert in range(weight.shape[0]):
        codes[expert], scales[expert] = quantize(weight[expert])
    return codes, scales
