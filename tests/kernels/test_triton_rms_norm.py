"""The Triton RMSNorm kernels against fasterllm.layers.norm.RMSNorm (the model's path): in Triton's interpreter
on a CPU, natively on a GPU."""
from __future__ import annotations

import pytest
import torch

from fasterllm.layers.norm import RMSNorm

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytest.importorskip("triton")
from fasterllm.kernels.rms_norm import fused_add_rms_norm, norm_add_rms_norm, rms_norm  # noqa: E402

gpu_only = pytest.mark.skipif(DEVICE.type != "cuda", reason="real model shapes need a GPU")
EPS = 1e-5
# Triton 3.9's interpreter rounds fp32 -> bf16 toward zero (a GPU rounds to nearest even): bf16 results are
# bit-checked on a GPU only; fp16 (rounded correctly by the interpreter) checks the rounding steps on a CPU
EXACT_HALF_DTYPES = [torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])


def reference_layer(hidden, dtype):
    """An RMSNorm on the CPU: its torch path is the reference (on a GPU the layer itself calls the kernels tested)."""
    layer = RMSNorm(hidden, EPS).to(dtype=dtype)
    with torch.no_grad():
        layer.weight.copy_(torch.rand(hidden) + 0.5)
    return layer


def on_cpu(layer, x, residual=None):
    """layer(x, residual) on CPU copies of the inputs, the outputs back on DEVICE."""
    with torch.no_grad():
        return tuple(t.to(DEVICE) for t in layer(x.cpu(), None if residual is None else residual.cpu()))


def assert_same_up_to_boundary_flips(got, expected):
    """fp32 sums in another order can put the normed value on the other side of a rounding boundary: one unit in
    its last place, which the weight (< 1.5) scales and the second rounding may round up to two units of the
    result. Allow that on at most 1 in 1000 elements, and nothing else."""
    differ = got != expected
    assert differ.float().mean() <= 1e-3, f"{int(differ.sum())} of {got.numel()} elements differ"
    ulp = torch.finfo(got.dtype).eps * expected.float().abs().clamp_min(torch.finfo(got.dtype).tiny)
    units = (got.float() - expected.float()).abs() / ulp
    assert (units <= 2).all(), f"{int((units > 2).sum())} elements differ by more than two units, at most {units.max()}"


def run(num_tokens, hidden, dtype, with_residual):
    torch.manual_seed(0)
    layer = reference_layer(hidden, dtype)
    x = (3 * torch.randn(num_tokens, hidden, device=DEVICE)).to(dtype)
    residual = torch.randn(num_tokens, hidden, device=DEVICE).to(dtype) if with_residual else None
    expected, expected_residual = on_cpu(layer, x, residual)
    weight = layer.weight.detach().to(DEVICE)
    if with_residual:
        got, got_residual = fused_add_rms_norm(x, residual, weight, EPS)
        if dtype in EXACT_HALF_DTYPES or dtype == torch.float32:  # one rounding of an exact sum: bit-exact
            assert torch.equal(got_residual, expected_residual)
        else:
            torch.testing.assert_close(got_residual, expected_residual, atol=2 ** -7, rtol=2 ** -7)
    else:
        got = rms_norm(x, weight, EPS)
    assert got.dtype == dtype and got.shape == x.shape
    if dtype in EXACT_HALF_DTYPES:
        assert_same_up_to_boundary_flips(got, expected)
    else:  # fp32, or bf16 in the interpreter (two roundings toward zero: up to two units in the last place)
        tolerance = 1e-5 if dtype == torch.float32 else 2 ** -6
        torch.testing.assert_close(got, expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_matches_model_norm(dtype, with_residual):
    run(6, 576, dtype, with_residual)  # SmolLM2's hidden size: not a power of two


@pytest.mark.parametrize("dtype", EXACT_HALF_DTYPES)
def test_half_bit_exact_on_a_small_batch(dtype):
    """Half types agree bit for bit on typical rows (the boundary flips above are rare)."""
    torch.manual_seed(1)
    layer = reference_layer(64, dtype)
    x, residual = (torch.randn(4, 64, device=DEVICE).to(dtype) for _ in range(2))
    expected = on_cpu(layer, x, residual)[0]
    assert torch.equal(fused_add_rms_norm(x, residual, layer.weight.detach().to(DEVICE), EPS)[0], expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_sandwich_norms_in_one_launch_match_two_norm_calls(dtype):
    """Gemma's post-sublayer norm, residual add and next norm in one launch equal the two RMSNorm calls: the new
    residual stream (what every later layer adds to) bit for bit where the interpreter rounds as a GPU does, the
    normed rows up to the boundary flips above."""
    torch.manual_seed(2)
    first, second = reference_layer(576, dtype), reference_layer(576, dtype)
    x = (3 * torch.randn(5, 576, device=DEVICE)).to(dtype)
    residual = torch.randn(5, 576, device=DEVICE).to(dtype)
    expected, expected_residual = on_cpu(second, on_cpu(first, x)[0], residual)
    got, got_residual = norm_add_rms_norm(x, residual, first.weight.detach().to(DEVICE), EPS,
                                          second.weight.detach().to(DEVICE), EPS)
    assert got.dtype == dtype and got_residual.dtype == dtype
    if dtype in EXACT_HALF_DTYPES:
        assert_same_up_to_boundary_flips(got_residual, expected_residual)
        assert_same_up_to_boundary_flips(got, expected)
    else:
        tolerance = 1e-5 if dtype == torch.float32 else 2 ** -5
        torch.testing.assert_close(got_residual, expected_residual, atol=tolerance, rtol=tolerance)
        torch.testing.assert_close(got, expected, atol=tolerance, rtol=tolerance)


def test_mismatched_weight_is_refused():
    x = torch.zeros(2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.ones(32, device=DEVICE), EPS)


@gpu_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", [4096, 576])  # Llama-3-8B, SmolLM2
def test_model_shapes(dtype, hidden):
    for with_residual in (False, True):
        run(512, hidden, dtype, with_residual)


def test_sandwich_norm_refuses_a_mismatched_first_weight():
    x = torch.zeros(2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="weight"):
        norm_add_rms_norm(x, x, torch.ones(32, device=DEVICE), EPS, torch.ones(64, device=DEVICE), EPS)
