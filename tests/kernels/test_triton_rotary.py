"""The Triton RoPE kernel against fasterllm.layers.rotary (the model's path): in Triton's interpreter on a CPU,
natively on a GPU."""
from __future__ import annotations

import pytest
import torch

from fasterllm.layers.rotary import RotaryEmbedding, apply_rotary as apply_rotary_reference, rope_inv_freq

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytest.importorskip("triton")
from fasterllm.kernels.rotary import apply_rotary  # noqa: E402

gpu_only = pytest.mark.skipif(DEVICE.type != "cuda", reason="real model shapes need a GPU")
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
# Triton 3.9's interpreter rounds fp32 -> bf16 toward zero (a GPU rounds to nearest even): bf16 results are
# bit-checked on a GPU only; fp16 (rounded correctly by the interpreter) checks the rounding steps on a CPU
EXACT_DTYPES = [torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])


def run(num_tokens, num_heads, num_kv_heads, head_dim, dtype, scaling=None, max_positions=4096):
    """Rotates Q and K as strided views of a fused QKV output; V must stay untouched."""
    torch.manual_seed(0)
    rotary = RotaryEmbedding(head_dim, max_positions, rope_inv_freq(head_dim, 500000.0, scaling), DEVICE, dtype)
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, device=DEVICE).to(dtype)
    positions = torch.randint(0, max_positions, (num_tokens,), device=DEVICE)
    cos, sin = rotary.cos_sin_for(positions)
    expected = qkv.clone()
    expected[:, :num_heads + num_kv_heads] = apply_rotary_reference(qkv[:, :num_heads + num_kv_heads], cos, sin)
    query, key = qkv[:, :num_heads], qkv[:, num_heads:num_heads + num_kv_heads]
    apply_rotary(query, key, positions, rotary.cos_sin)
    if dtype in EXACT_DTYPES:
        assert torch.equal(qkv, expected)
    else:  # fp32 (the sum may be fused into one FMA), or bf16 in the interpreter (rounded toward zero)
        tolerance = 1e-6 if dtype == torch.float32 else 2 ** -6
        torch.testing.assert_close(qkv, expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("scaling", [None, LLAMA3])
def test_matches_model_rotary(dtype, scaling):
    run(7, 4, 2, 64, dtype, scaling)


def test_three_query_heads_per_kv_head_and_head_dim_96():
    run(5, 6, 2, 96, torch.float16)


def test_mismatched_table_is_refused():
    query = torch.zeros(2, 4, 64, device=DEVICE)
    with pytest.raises(ValueError, match="cos_sin must be"):
        apply_rotary(query, query[:, :2], torch.zeros(2, dtype=torch.long, device=DEVICE),
                     torch.zeros(8, 64, device=DEVICE))


@gpu_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [(32, 8, 128), (9, 3, 64)])  # Llama-3-8B, SmolLM2
def test_model_shapes(dtype, heads):
    run(1000, *heads, dtype, LLAMA3 if heads[0] == 32 else None, max_positions=8192)
