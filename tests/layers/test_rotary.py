"""LongRoPE tables (Phi-3 128k, Phi-3.5): short factors before original_max_position_embeddings, long ones from
there on, cos and sin scaled by the attention factor. Positions below the boundary are checked against transformers
in tests/parity (phi3_longrope); the positions past it here, against the formula."""
from __future__ import annotations

import math

import torch

from fasterllm.layers.rotary import rotary_embedding

HEAD_DIM, ORIGINAL, MAX_POSITIONS = 16, 32, 128
SHORT, LONG = [1.0 + 0.1 * i for i in range(8)], [3.0 + i for i in range(8)]


def expected_row(position: int, factors: list[float], scale: float) -> torch.Tensor:
    inv_freq = 1.0 / (torch.tensor(factors, dtype=torch.float64)
                      * 10000.0 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM))
    angles = position * inv_freq.float()
    cos, sin = angles.cos() * scale, angles.sin() * scale
    return torch.cat([cos, cos, -sin, sin])


def test_longrope_switches_to_the_long_factors_at_the_original_length():
    scaling = {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG,
               "original_max_position_embeddings": ORIGINAL, "factor": MAX_POSITIONS / ORIGINAL}
    rotary = rotary_embedding(HEAD_DIM, MAX_POSITIONS, 10000.0, scaling, None, torch.device("cpu"), torch.float32)
    scale = math.sqrt(1 + math.log(MAX_POSITIONS / ORIGINAL) / math.log(ORIGINAL))
    for position, factors in ((5, SHORT), (ORIGINAL - 1, SHORT), (ORIGINAL, LONG), (100, LONG)):
        torch.testing.assert_close(rotary.cos_sin[position], expected_row(position, factors, scale))


def test_longrope_with_a_context_shorter_than_the_original_length_uses_the_short_factors():
    scaling = {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG,
               "original_max_position_embeddings": ORIGINAL, "factor": MAX_POSITIONS / ORIGINAL}
    short_context = ORIGINAL // 2  # max_model_len below original_max_position_embeddings
    rotary = rotary_embedding(HEAD_DIM, short_context, 10000.0, scaling, None, torch.device("cpu"), torch.float32)
    scale = math.sqrt(1 + math.log(MAX_POSITIONS / ORIGINAL) / math.log(ORIGINAL))
    assert rotary.cos_sin.shape[0] == short_context
    torch.testing.assert_close(rotary.cos_sin[short_context - 1], expected_row(short_context - 1, SHORT, scale))
