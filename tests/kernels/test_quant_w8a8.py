"""The W8A8 int8 GEMM (int32 sums, dequantizing epilogue) against exact integer sums in torch: in Triton's
interpreter on a CPU (small shapes), natively on a GPU (the Llama-3-8B shapes, decode and prefill). Decode rows go
through decode_gemm.py's GEMM where it runs (Hopper, and the interpreter) and N is a multiple of its 64-column tiles,
through torch._int_mm and the epilogue kernel otherwise; prefill rows and shapes _int_mm refuses through the Triton
GEMM."""
from __future__ import annotations

import pytest
import torch

from fasterllm.layers.quantization.int8 import quantize_int8_per_channel

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytest.importorskip("triton")
from fasterllm.kernels.quant_activation import quantize_per_token  # noqa: E402
from fasterllm.kernels.quant_w8a8 import DECODE_MAX_ROWS, int8_gemm, int8_gemm_reference  # noqa: E402

gpu_only = pytest.mark.skipif(DEVICE.type != "cuda", reason="real model shapes need a GPU")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def check(m, n, k, dtype, with_bias=True):
    torch.manual_seed(0)
    weight = torch.randn(n, k, device=DEVICE) * 0.05
    qweight, scales = quantize_int8_per_channel(weight)
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    qx, x_scales = quantize_per_token(x)
    bias = torch.randn(n, device=DEVICE).to(dtype) if with_bias else None
    got = int8_gemm(qx, x_scales, qweight, scales, bias, dtype)
    expected = int8_gemm_reference(qx, x_scales, qweight, scales, bias, dtype)
    assert got.shape == (m, n) and got.dtype == dtype and torch.isfinite(got).all()
    # the integer sums are exact: only the final rounding to dtype may differ (one unit in the last place)
    ulp = torch.finfo(dtype).eps * expected.float().abs().clamp_min(1.0)
    assert ((got.float() - expected.float()).abs() <= ulp).all()
    exact = x.float() @ weight.t() + (0 if bias is None else bias.float())
    assert (got.float() - exact).abs().max() <= 0.03 * exact.abs().max()  # W8A8's own error


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 7, 40])  # decode rows: padded to 17 for torch._int_mm, then as they are
@pytest.mark.parametrize("n", [200, 256])  # 256: decode_gemm's tiles
def test_decode_rows_match_integer_reference(dtype, m, n):
    check(m, n, 576, dtype)


def test_decode_rows_of_a_shape_int_mm_refuses_use_the_triton_gemm():
    check(5, 150, 320, torch.float16)  # N not a multiple of 8


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_large_m_tiles_match_integer_reference(dtype):
    check(DECODE_MAX_ROWS + 70, 150, 320, dtype, with_bias=False)


def test_bad_operands_are_refused():
    a = torch.zeros(2, 64, dtype=torch.int8, device=DEVICE)
    with pytest.raises(ValueError, match="int8"):
        int8_gemm(a.float(), torch.ones(2, device=DEVICE), a, torch.ones(2, device=DEVICE), None, torch.float32)
    with pytest.raises(ValueError, match="one value per row"):
        int8_gemm(a, torch.ones(3, device=DEVICE), a, torch.ones(2, device=DEVICE), None, torch.float32)


@gpu_only
@pytest.mark.parametrize("m", [1, 16, 64, 512])
@pytest.mark.parametrize("n, k", [(6144, 4096), (2 * 14336, 4096), (4096, 14336)])
def test_llama_8b_shapes(m, n, k):
    check(m, n, k, torch.bfloat16)
