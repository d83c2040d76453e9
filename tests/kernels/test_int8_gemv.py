"""The Gluon int8 matrix-vector kernel (kernels/int8_gemv.py). Triton's interpreter cannot run Gluon, so on a CPU
the kernel's reading of the bytes is replayed in torch (which code meets which x, the prmt floats); on a GPU the
kernel itself, every tile candidate, against the dequantized product and gemv.py's Triton kernel, and the int8
layer's one-row path through it."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from fasterllm.kernels.gemv import gemv  # noqa: E402
from fasterllm.kernels.quant_weight_only import weight_only_matmul  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
gpu_only = pytest.mark.skipif(DEVICE.type != "cuda", reason="the Gluon kernel runs on an NVIDIA GPU only")


def int8_weight(n, k, seed=0):
    torch.manual_seed(seed)
    codes = torch.randint(-127, 128, (n, k), dtype=torch.int8, device=DEVICE)
    scales = torch.rand(n, device=DEVICE) * 0.01 + 0.001
    return codes, scales


def reference(x, codes, scales, bias=None):
    out = (x.float() @ codes.float().t()) * scales
    return out if bias is None else out + bias.float()


def test_kernel_reading_is_the_weights_product():
    """Word j of a row's codes meets x's int64 word j (its low int32's two bf16, then its high one's), and the
    byte placed under 2^23 after the sign flip, less 2^23 + 128, is the code: x @ codes^T, exactly in fp32."""
    n, k = 24, 64
    torch.manual_seed(1)
    codes = torch.randint(-128, 128, (n, k), dtype=torch.int8)
    x = torch.randn(1, k).to(torch.bfloat16)
    words = codes.view(torch.int32) ^ -2139062144  # 0x80808080
    x_words = x.view(torch.int64)[0]
    low, high = x_words.to(torch.int32), (x_words >> 32).to(torch.int32)
    xs = [(low << 16).view(torch.float32), (low & -65536).view(torch.float32),
          (high << 16).view(torch.float32), (high & -65536).view(torch.float32)]
    out = torch.zeros(n)
    for byte, x_of_byte in enumerate(xs):
        values = (((words >> (8 * byte)) & 0xFF) | 0x4B000000).view(torch.float32) - 8388736.0
        out += (values * x_of_byte).sum(1)
    torch.testing.assert_close(out, (x.float() @ codes.float().t())[0], rtol=1e-6, atol=1e-4)


@gpu_only
@pytest.mark.parametrize("n,k", [(4096, 4096), (1000, 1040), (6144, 4096), (4096, 14336), (40, 16)])
def test_every_tile_matches_the_reference(n, k):
    from fasterllm.kernels.int8_gemv import CANDIDATES, int8_gemv
    codes, scales = int8_weight(n, k)
    x = torch.randn(1, k, device=DEVICE).to(torch.bfloat16)
    bias = torch.randn(n, device=DEVICE).to(torch.bfloat16)
    want = reference(x, codes, scales, bias)
    triton_kernel = gemv(x, codes, scales, bias).float()
    for tile in CANDIDATES:
        got = int8_gemv(x, codes, scales, bias, tile=tile).float()
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2, msg=f"tile {tile}")
        torch.testing.assert_close(got, triton_kernel, rtol=1e-2, atol=1e-2, msg=f"tile {tile} against gemv.py")


@gpu_only
def test_int8_rows_take_it_where_it_fits_and_gemv_elsewhere():
    """weight_only_matmul's one bf16 row: the Gluon kernel for K a multiple of 16, gemv.py's for other K and
    dtypes; both give the product."""
    from fasterllm.kernels.int8_gemv import fits
    for k, dtype in [(4096, torch.bfloat16), (1000, torch.bfloat16), (4096, torch.float16)]:
        codes, scales = int8_weight(512, k)
        x = torch.randn(1, k, device=DEVICE).to(dtype)
        assert fits(x, codes) == (k % 16 == 0 and dtype == torch.bfloat16)
        torch.testing.assert_close(weight_only_matmul(x, codes, scales).float(), reference(x, codes, scales),
                                   rtol=1e-2, atol=1e-2)
