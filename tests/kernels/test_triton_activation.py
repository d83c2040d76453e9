"""The Triton activation-and-mul against the models' `act(gate) * up` (SiLU, GELU exact and tanh, ReLU): in Triton's
interpreter on a CPU, natively on a GPU."""
from __future__ import annotations

import pytest
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytest.importorskip("triton")
from fasterllm.kernels.activation import ACTIVATIONS, act_and_mul  # noqa: E402
from fasterllm.layers.activation import TORCH_ACTIVATIONS  # noqa: E402

gpu_only = pytest.mark.skipif(DEVICE.type != "cuda", reason="real model shapes need a GPU")
# Triton 3.9's interpreter rounds fp32 -> bf16 toward zero (a GPU rounds to nearest even): bf16 results are
# bit-checked on a GPU only; fp16 (rounded correctly by the interpreter) checks the rounding steps on a CPU
EXACT_DTYPES = [torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])


def run(num_tokens, intermediate, dtype, activation="silu"):
    torch.manual_seed(0)
    x = (4 * torch.randn(num_tokens, 2 * intermediate, device=DEVICE)).to(dtype)
    gate, up = x.chunk(2, dim=-1)
    expected = TORCH_ACTIVATIONS[activation](gate) * up  # exactly as the models' torch path
    got = act_and_mul(x, activation)
    assert got.shape == expected.shape and got.dtype == dtype
    if dtype in EXACT_DTYPES and activation.startswith("gelu"):
        # torch's GELU takes 1 + tanh (or erf) of a large negative input apart in fp32 (its CPU fp16 GELU rounds
        # differently again); the kernel's 2 / (1 + exp(-2u)) does not: equal up to an ulp of the largest value
        eps = torch.finfo(dtype).eps
        torch.testing.assert_close(got.float(), expected.float(), atol=eps * expected.float().abs().max().item(),
                                   rtol=2 * eps)
    elif dtype in EXACT_DTYPES:
        # exp's last fp32 bit may differ (fast exp on a GPU): a rare flip at a rounding boundary, one ulp
        differ = got != expected
        assert differ.float().mean() <= 1e-3, f"{int(differ.sum())} of {got.numel()} elements differ"
        torch.testing.assert_close(got, expected, atol=0.0, rtol=2 * torch.finfo(dtype).eps)
    else:
        tolerance = 1e-5 if dtype == torch.float32 else 2 ** -6
        torch.testing.assert_close(got, expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("activation", list(ACTIVATIONS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_matches_model_mlp_activation(dtype, activation):
    run(5, 1536 + 40, dtype, activation)  # SmolLM2's 1536, plus a partial last block


def test_odd_width_and_unknown_activation_are_refused():
    with pytest.raises(ValueError, match="2 \\* intermediate"):
        act_and_mul(torch.zeros(2, 7, device=DEVICE))
    with pytest.raises(ValueError, match="'swiglu' is not one of silu, gelu_tanh, gelu, relu"):
        act_and_mul(torch.zeros(2, 8, device=DEVICE), "swiglu")


@gpu_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("intermediate, activation", [(14336, "silu"), (1536, "silu"), (14336, "gelu_tanh")])
def test_model_shapes(dtype, intermediate, activation):  # Llama-3-8B, SmolLM2, Gemma-2-9B
    run(512, intermediate, dtype, activation)
