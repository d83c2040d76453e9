"""The per-token quantize kernels (alone, after SiLU*mul, after residual-add + RMSNorm) against the float layers
followed by the torch reference quantizer: in Triton's interpreter on a CPU, natively on a GPU."""
from __future__ import annotations

import pytest
import torch

from fasterllm.layers.activation import act_and_mul
from fasterllm.layers.norm import RMSNorm

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytest.importorskip("triton")
from fasterllm.kernels.quant_activation import (  # noqa: E402
    QMAX, quantize_per_token, quantize_per_token_reference, rms_norm_quantize, silu_and_mul_quantize)

gpu_only = pytest.mark.skipif(DEVICE.type != "cuda", reason="real model shapes need a GPU")
EPS = 1e-5
Q_DTYPES = [torch.int8, torch.float8_e4m3fn]
# Triton 3.9's interpreter rounds fp32 -> bf16 toward zero: bf16 inputs are compared on a GPU only
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])


def assert_same_codes(got, expected, q_dtype):
    """Codes agree except where the fp32 value sits on a rounding tie (another fp32 rounding of x * 127 / absmax
    puts it on the other side): at most 1 in 200, and then by one step only."""
    assert got.dtype == q_dtype and got.shape == expected.shape
    g, e = got.float(), expected.float()
    assert torch.isfinite(g).all()
    differ = g != e
    assert differ.float().mean() <= 5e-3, f"{int(differ.sum())} of {g.numel()} codes differ"
    step = 1.0 if q_dtype == torch.int8 else 2.0 ** -3 * e.abs().clamp_min(2.0 ** -6)  # e4m3: 3 mantissa bits
    assert ((g - e).abs() <= step).all()


def check(got, reference_input, q_dtype):
    q, scales = got
    expected_q, expected_scales = quantize_per_token_reference(reference_input, q_dtype)
    assert scales.shape == (reference_input.shape[0], 1) and scales.dtype == torch.float32
    torch.testing.assert_close(scales, expected_scales, rtol=1e-6, atol=0)
    assert_same_codes(q, expected_q, q_dtype)
    # what a user notices: the dequantized values are within half a step of the float ones
    error = (q.float() * scales - reference_input.float()).abs()
    assert (error <= scales * (0.5 if q_dtype == torch.int8 else QMAX[q_dtype] / 16) + 1e-6).all()


@pytest.mark.parametrize("width", [2500, 16500])  # the row in one chunk (one read); two chunks, the second partial
@pytest.mark.parametrize("q_dtype", Q_DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_per_token(dtype, q_dtype, width):
    torch.manual_seed(0)
    x = (3 * torch.randn(6, width, device=DEVICE)).to(dtype)
    x[2] = 0  # an all-zero row: zeros and a tiny scale, never NaN
    check(quantize_per_token(x, q_dtype), x, q_dtype)
    assert (quantize_per_token(x, q_dtype)[0][2].float() == 0).all()


@pytest.mark.parametrize("q_dtype", Q_DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_quantize_matches_the_float_activation(dtype, q_dtype):
    torch.manual_seed(1)
    gate_up = (3 * torch.randn(5, 2 * 1576, device=DEVICE)).to(dtype)
    check(silu_and_mul_quantize(gate_up, q_dtype), act_and_mul(gate_up), q_dtype)


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("q_dtype", Q_DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_quantize_matches_the_float_norm(dtype, q_dtype, with_residual):
    torch.manual_seed(2)
    norm = RMSNorm(576, EPS).to(device=DEVICE, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(576, device=DEVICE) + 0.5)
    x = (3 * torch.randn(7, 576, device=DEVICE)).to(dtype)
    residual = torch.randn(7, 576, device=DEVICE).to(dtype) if with_residual else None
    with torch.no_grad():
        normed, expected_residual = norm(x, residual)
    q, scales, new_residual = rms_norm_quantize(x, residual, norm.weight, EPS, q_dtype)
    assert torch.equal(new_residual, expected_residual)
    check((q, scales), normed, q_dtype)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="q_dtype"):
        quantize_per_token(torch.zeros(2, 16, device=DEVICE), torch.float16)
    with pytest.raises(ValueError, match="2 \\* intermediate"):
        silu_and_mul_quantize(torch.zeros(2, 15, device=DEVICE))


@gpu_only
@pytest.mark.parametrize("q_dtype", Q_DTYPES)
def test_model_shapes(q_dtype):
    torch.manual_seed(3)
    x = torch.randn(256, 4096, device=DEVICE, dtype=torch.bfloat16)
    check(quantize_per_token(x, q_dtype), x, q_dtype)
    gate_up = torch.randn(64, 2 * 14336, device=DEVICE, dtype=torch.bfloat16)
    check(silu_and_mul_quantize(gate_up, q_dtype), act_and_mul(gate_up), q_dtype)
