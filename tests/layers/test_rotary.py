"""LongRoPE tables (Phi-3 128k, Phi-3.5): short factors before original_max_position_embeddings, long ones from
there on, cos and sin scaled by the attention factor. Positions below the boundary are checked against transformers
in tests/parity (phi3_longrope); the positions past it here, against the formula. YaRN's frequencies and cos/sin
scale against transformers' YaRN (whole models with it: tests/parity's deepseek_v2 specs)."""
from __future__ import annotations

import math

import pytest
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


# YaRN: DeepSeek-V2-Lite's real parameters (mscale = mscale_all_dim), a DeepSeek-style pair that differs, and a plain
# one without mscales (Qwen / Llama configs), against transformers' own YaRN
YARN_CASES = [
    ("deepseek_v2_lite", 64, {"factor": 40.0, "mscale": 0.707, "mscale_all_dim": 0.707,
                              "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1}),
    ("mscales_differ", 16, {"factor": 8.0, "mscale": 1.0, "mscale_all_dim": 0.5,
                            "original_max_position_embeddings": 32}),
    ("plain", 32, {"factor": 4.0, "original_max_position_embeddings": 1024}),
    ("attention_factor_given", 32, {"factor": 4.0, "attention_factor": 0.8, "original_max_position_embeddings": 512,
                                    "truncate": False}),
]


@pytest.mark.parametrize("name, head_dim, params", YARN_CASES, ids=[case[0] for case in YARN_CASES])
def test_yarn_frequencies_and_scale_match_transformers(name, head_dim, params):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from fasterllm.layers.rotary import rope_inv_freq, yarn_rotary_scale

    scaling = {"rope_type": "yarn", **params}
    config = transformers.LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                                      max_position_embeddings=4 * params["original_max_position_embeddings"],
                                      rope_parameters={**scaling, "rope_theta": 10000.0})
    expected_inv_freq, expected_scale = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    torch.testing.assert_close(rope_inv_freq(head_dim, 10000.0, scaling), expected_inv_freq.float(), rtol=1e-6,
                               atol=0)
    assert yarn_rotary_scale(scaling) == pytest.approx(expected_scale, rel=1e-12)
    rotary = rotary_embedding(head_dim, 64, 10000.0, scaling, None, torch.device("cpu"), torch.float32)
    angles = 63 * rope_inv_freq(head_dim, 10000.0, scaling)
    torch.testing.assert_close(rotary.cos_sin[63, :head_dim // 2], angles.cos() * expected_scale)
