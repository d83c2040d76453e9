"""The fused add-bias + residual + LayerNorm kernel against its torch reference and against the unfused
layer sequence the CPU path runs (GEMM + bias, residual add, nn.LayerNorm): in Triton's interpreter on a CPU,
natively on a GPU."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytest.importorskip("triton")
from fasterllm.kernels.layer_norm import (  # noqa: E402
    add_bias_residual_layer_norm, add_bias_residual_layer_norm_reference)

# (tokens, hidden): a hidden below, at and between powers of two; the GPU also gets BERT-base/large shapes
SHAPES = [(5, 32), (7, 48), (3, 384)] + ([(4096, 768), (1000, 1024)] if DEVICE.type == "cuda" else [])
# Triton 3.9's interpreter rounds fp32 -> bf16 toward zero: bf16 is checked on a GPU only
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
EPS = 1e-12


def inputs(tokens, hidden, dtype):
    torch.manual_seed(0)
    x = (2 * torch.randn(tokens, hidden, device=DEVICE) + 0.5).to(dtype)
    residual = torch.randn(tokens, hidden, device=DEVICE).to(dtype)
    bias, weight, norm_bias = (torch.randn(hidden, device=DEVICE).to(dtype) for _ in range(3))
    return x, bias, residual, weight, norm_bias


@pytest.mark.parametrize("tokens, hidden", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_matches_reference(tokens, hidden, dtype):
    args = inputs(tokens, hidden, dtype)
    got = add_bias_residual_layer_norm(*args, EPS)
    expected = add_bias_residual_layer_norm_reference(*args, EPS)
    assert got.dtype == dtype and got.shape == (tokens, hidden)
    tolerance = 1e-5 if dtype == torch.float32 else torch.finfo(dtype).eps * 4  # a rounding step of |y| < ~4
    torch.testing.assert_close(got, expected, atol=tolerance, rtol=tolerance)


def test_kernel_equals_the_unfused_layer_sequence_in_fp32():
    x, bias, residual, weight, norm_bias = inputs(6, 96, torch.float32)
    unfused = F.layer_norm(x + bias + residual, (96,), weight, norm_bias, EPS)
    torch.testing.assert_close(add_bias_residual_layer_norm(x, bias, residual, weight, norm_bias, EPS), unfused,
                               atol=1e-5, rtol=1e-5)


def test_without_a_bias_the_rows_are_summed_with_the_residual_only():
    """bias=None: x carries its bias already (a post-norm encoder-decoder layer's projection output)."""
    x, _, residual, weight, norm_bias = inputs(6, 96, torch.float32)
    torch.testing.assert_close(add_bias_residual_layer_norm(x, None, residual, weight, norm_bias, EPS),
                               F.layer_norm(x + residual, (96,), weight, norm_bias, EPS), atol=1e-5, rtol=1e-5)


def test_strided_rows_are_read_by_their_stride():
    x, bias, residual, weight, norm_bias = inputs(4, 64, torch.float32)
    wide = torch.cat([x, torch.full_like(x, 1e4)], dim=1)  # rows of x inside a wider tensor
    got = add_bias_residual_layer_norm(wide[:, :64], bias, residual, weight, norm_bias, EPS)
    torch.testing.assert_close(got, add_bias_residual_layer_norm_reference(x, bias, residual, weight, norm_bias, EPS),
                               atol=1e-5, rtol=1e-5)


def test_mismatched_shapes_are_named():
    x, bias, residual, weight, norm_bias = inputs(4, 64, torch.float32)
    with pytest.raises(ValueError, match=r"bias, weight and norm_bias must be \[64\]"):
        add_bias_residual_layer_norm(x, bias[:32], residual, weight, norm_bias, EPS)
    with pytest.raises(ValueError, match="x and residual must be"):
        add_bias_residual_layer_norm(x, bias, residual[:2], weight, norm_bias, EPS)
