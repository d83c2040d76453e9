"""The Gluon int4 matrix-vector kernel (kernels/int4_gemv.py). Triton's interpreter cannot run Gluon, so on a CPU
the kernel's layout and arithmetic are replayed in torch (which nibble meets which x, the lop3 floats, the sums it
takes apart); on a GPU the kernel itself, every tile candidate, against tinygemm_reference and torch's kernel."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from int4_weights import int4_weight as weight_on  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
gpu_only = pytest.mark.skipif(DEVICE.type != "cuda", reason="the Gluon kernel runs on an NVIDIA GPU only")
# (shift of the word, the nibble's bits 16-19 (True) or 12-15, the x it meets: pair p's low (False) or high bf16)
NIBBLE_TERMS = [(12, False, 0, False), (12, True, 1, False), (8, True, 2, False), (0, False, 3, False),
                (0, True, 0, True), (-8, False, 1, True), (-8, True, 2, True), (-12, True, 3, True)]


def int4_weight(n, k, group_size):
    """(words, scale_zeros, the fp32 weight)."""
    return weight_on(n, k, group_size, DEVICE)[1:]


def as_float(bits: torch.Tensor) -> torch.Tensor:
    return bits.contiguous().view(torch.float32)


def kernel_arithmetic(x: torch.Tensor, packed: torch.Tensor, scale_zeros: torch.Tensor, group_size: int):
    """int4_gemv's arithmetic in torch, on its words and bf16 pairs as it reads them."""
    n, k = packed.shape[0] * 8, x.shape[-1]
    words = packed.view(n // 8, k // 32, 8, 4)  # [block, tile, row, word j]
    pairs = x.view(torch.int32).view(k // 32, 4, 4)  # [tile, pair p, word j]
    dots = torch.zeros(words.shape)
    ones, sixteens = torch.zeros(k // 32, 4), torch.zeros(k // 32, 4)
    for shift, high, p, high_x in NIBBLE_TERMS:
        shifted = words << shift if shift >= 0 else words >> -shift
        values = as_float((shifted & (0xF0000 if high else 0xF000)) | (0x3F800000 if high else 0x41800000))
        xs = as_float(pairs[:, p] & -65536 if high_x else pairs[:, p] << 16)
        dots += values * xs[None, :, None, :]
        if high:
            ones += xs
        else:
            sixteens += xs
    x_sums, offsets = (ones + sixteens).sum(-1), (ones + 16 * sixteens).sum(-1)  # [tile]
    sz = scale_zeros.view(torch.int32)[torch.arange(k // 32) // (group_size // 32), :, 0]  # [tile, n]
    scale, zero = as_float(sz << 16), as_float(sz & -65536)
    products = dots.sum(-1).permute(1, 0, 2).reshape(k // 32, n)  # [tile, n]
    return ((128 * scale) * (products - offsets[:, None]) + (zero - 8 * scale) * x_sums[:, None]).sum(0)


@pytest.mark.parametrize("group_size", [32, 128])
def test_kernel_arithmetic_is_the_weights_product(group_size):
    """The nibble each term reads, the x it meets, and 128 s (sum (c + q / 128) x - sum c x) + (z - 8 s) sum x
    give x @ W^T: a wrong pairing of nibble and x, or of magic and scale, is off by the size of the product."""
    packed, scale_zeros, weight = int4_weight(16, 256, group_size)
    x = torch.randn(1, 256).to(torch.bfloat16)
    expected = (x.float() @ weight.cpu().t())[0]
    got = kernel_arithmetic(x, packed.cpu(), scale_zeros.cpu(), group_size)
    torch.testing.assert_close(got, expected, atol=1e-4 * expected.abs().max().item(), rtol=0)


@gpu_only
@pytest.mark.parametrize("n, k, group_size", [(72, 576, 32), (64, 640, 128), (136, 768, 256), (4096, 14336, 32)])
def test_int4_gemv_every_tile_against_the_reference(n, k, group_size):
    """Partial program blocks (72 rows), tile counts that are not a multiple of a step's tiles (18-24), groups of
    32-256, the down projection's K; bias or not."""
    from fasterllm.kernels.int4_gemv import CANDIDATES, int4_gemv

    packed, scale_zeros, weight = int4_weight(n, k, group_size)
    x = torch.randn(1, k, device=DEVICE).to(torch.bfloat16)
    bias = torch.randn(n, device=DEVICE).to(torch.bfloat16)
    for tile in CANDIDATES:
        for b in (None, bias):
            expected = x.float() @ weight.t() + (0 if b is None else b.float())
            got = int4_gemv(x, packed, scale_zeros, group_size, b, tile=tile)
            assert got.shape == (1, n) and got.dtype == torch.bfloat16
            torch.testing.assert_close(got.float(), expected, atol=1e-2 * expected.abs().max().item(), rtol=0)


@gpu_only
def test_int4_gemv_agrees_with_torchs_kernel():
    from fasterllm.kernels.int4_gemv import int4_gemv

    packed, scale_zeros, _ = int4_weight(4096, 4096, 32)
    x = torch.randn(1, 4096, device=DEVICE).to(torch.bfloat16)
    theirs = torch._weight_int4pack_mm(x, packed, 32, scale_zeros).float()
    torch.testing.assert_close(int4_gemv(x, packed, scale_zeros, 32).float(), theirs,
                               atol=1e-2 * theirs.abs().max().item(), rtol=0)


def test_int4_gemv_refuses_what_it_cannot_read():
    from fasterllm.kernels.int4_gemv import int4_gemv

    packed, scale_zeros, _ = int4_weight(16, 128, 32)
    with pytest.raises(ValueError, match="one bf16 row"):
        int4_gemv(torch.randn(1, 128, device=DEVICE), packed, scale_zeros, 32)
    with pytest.raises(ValueError, match="one bf16 row"):
        int4_gemv(torch.randn(2, 128, device=DEVICE).to(torch.bfloat16), packed, scale_zeros, 32)
