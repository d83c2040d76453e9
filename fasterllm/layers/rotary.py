"""Rotary position embedding (rotate-half form) with the llama3, linear, YaRN and LongRoPE frequency scalings."""
from __future__ import annotations

import math
from typing import Any

import torch


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None,
                  freq_factors: torch.Tensor | None = None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors.to(torch.float64)
    if scaling is None:
        return inv_freq.float()
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return (inv_freq / scaling["factor"]).float()
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling).float()
    if kind == "yarn":
        return _yarn_inv_freq(inv_freq, head_dim, theta, scaling).float()
    raise ValueError(f"rope scaling type {kind!r} is not supported; supported: llama3, linear, yarn, longrope "
                     "(or none)")


def rotary_embedding(head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None,
                     freq_factors: torch.Tensor | None, device: torch.device, dtype: torch.dtype) -> RotaryEmbedding:
    """The tables for a layer's RoPE. LongRoPE (Phi-3 128k, Phi-3.5; "su" in older configs): positions before
    original_max_position_embeddings rotate by the short factors, later ones by the long factors (by position, as
    vLLM does: a sequence's early keys keep their rotation as it grows), both scaled by the attention factor."""
    kind = None if scaling is None else scaling.get("rope_type", scaling.get("type"))
    if kind not in ("longrope", "su"):
        scale = yarn_rotary_scale(scaling) if kind == "yarn" else 1.0
        return RotaryEmbedding(head_dim, max_positions, rope_inv_freq(head_dim, theta, scaling, freq_factors), device,
                               dtype, scale=scale)
    original = scaling["original_max_position_embeddings"]
    base = theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    short, long = (1.0 / (torch.tensor(scaling[key], dtype=torch.float64) * base) for key in ("short_factor",
                                                                                               "long_factor"))
    factor = scaling["factor"]
    attention_factor = scaling.get("attention_factor") or (
        math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0)
    return RotaryEmbedding(head_dim, max_positions, short.float(), device, dtype, (original, long.float()),
                           attention_factor)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a linear blend in between."""
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    original_context = scaling.get("original_max_position_embeddings", 8192)
    wavelength = 2 * math.pi / inv_freq
    blend = (original_context / wavelength - low) / (high - low)
    blended = (1 - blend) * inv_freq / factor + blend * inv_freq
    result = torch.where(wavelength > original_context / low, inv_freq / factor, inv_freq)
    in_between = (wavelength <= original_context / low) & (wavelength >= original_context / high)
    return torch.where(in_between, blended, result)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched by factor."""
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def yarn_rotary_scale(scaling: dict[str, Any]) -> float:
    """The factor YaRN scales cos and sin by: attention_factor if the config gives one, else mscale(mscale) /
    mscale(mscale_all_dim) when both are set (DeepSeek-V2), else mscale(1)."""
    if scaling.get("attention_factor") is not None:
        return scaling["attention_factor"]
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_mscale(scaling["factor"], mscale) / yarn_mscale(scaling["factor"], mscale_all_dim)
    return yarn_mscale(scaling["factor"])


def _yarn_inv_freq(inv_freq: torch.Tensor, head_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN: frequencies that turn fewer than beta_slow times over the original context are slowed by `factor`,
    those that turn more than beta_fast times kept, a linear ramp over the dimensions in between."""
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dimension_of(rotations: float) -> float:  # the dimension whose frequency turns `rotations` times
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension_of(beta_fast), dimension_of(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


class RotaryEmbedding:
    """cos/sin tables for every position up to max_positions, applied to Q and K in one call."""

    def __init__(self, head_dim: int, max_positions: int, inv_freq: torch.Tensor,
                 device: torch.device, dtype: torch.dtype, later: tuple[int, torch.Tensor] | None = None,
                 scale: float = 1.0):
        """later: (first position, inv_freq) for the positions from there on (LongRoPE); scale: of cos and sin."""
        self.head_dim = head_dim
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        if later is not None and later[0] < max_positions:  # a max_model_len below `first` never gets there
            first, later_inv_freq = later
            angles[first:] = torch.outer(torch.arange(first, max_positions, dtype=torch.float32), later_inv_freq)
        cos, sin = angles.cos() * scale, angles.sin() * scale
        # full-width tables, sin signed for the rotate-half form: x * cos + swap_halves(x) * sin
        self.cos_sin = torch.cat([cos, cos, -sin, sin], dim=-1).to(device=device, dtype=dtype)

    def cos_sin_for(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token tables, gathered once per step and shared by every layer: [T, 1, D] each."""
        cos, sin = self.cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """x: [T, heads, D] -> rotated (rotate-half form, as Hugging Face's LLaMA): a new tensor, or written
    into out (which may be x itself: the CPU decode rotates Q and K inside the QKV output)."""
    swapped_halves = x.roll(x.shape[-1] // 2, dims=-1)  # [x2, x1]: one op where chunk + cat take two
    return torch.addcmul(x * cos, swapped_halves, sin, out=out)
