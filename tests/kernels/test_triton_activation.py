"""The Triton SiLU-and-mul against the model's `F.silu(gate) * up`: in Triton's interpreter on a CPU,
natively on a GPU."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytest.importorskip("triton")
from fasterllm.kernels.activation import silu_and_mul  # noqa: E402

gpu_only = pytest.mark.skipif(DEVICE.type != "cuda", reason="real model shapes need a GPU")
# Triton 3.9's interpreter rounds fp32 -> bf16 toward zero (a GPU rounds to nearest even): bf16 results are
# bit-checked on a GPU only; fp16 (rounded correctly by the interpreter) checks the rounding steps on a CPU
EXACT_DTYPES = [torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])


def run(num_tokens, intermediate, dtype):
    torch.manual_seed(0)
    x = (4 * torch.randn(num_tokens, 2 * intermediate, device=DEVICE)).to(dtype)
    gate, up = x.chunk(2, dim=-1)
    expected = F.silu(gate) * up  # exactly as models/llama.py
    got = silu_and_mul(x)
    assert got.shape == expected.shape and got.dtype == dtype
    if dtype in EXACT_DTYPES:
        # exp's last fp32 bit may differ (fast exp on a GPU): a rare flip at a rounding boundary, one ulp
        differ = got != expected
        assert differ.float().mean() <= 1e-3, f"{int(differ.sum())} of {got.numel()} elements differ"
        torch.testing.assert_close(got, expected, atol=0.0, rtol=2 * torch.finfo(dtype).eps)
    else:
        tolerance = 1e-5 if dtype == torch.float32 else 2 ** -6
        torch.testing.assert_close(got, expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_matches_model_mlp_activation(dtype):
    run(5, 1536 + 40, dtype)  # SmolLM2's 1536, plus a partial last block


def test_odd_width_is_refused():
    with pytest.raises(ValueError, match="2 \\* intermediate"):
        silu_and_mul(torch.zeros(2, 7, device=DEVICE))


@gpu_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("intermediate", [14336, 1536])  # Llama-3-8B, SmolLM2
def test_model_shapes(dtype, intermediate):
    run(512, intermediate, dtype)
