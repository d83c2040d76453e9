"""The Gluon int8 matrix-vector kernel (kernels/int8_gemv.py). Triton's interpreter cannot run Gluon, so on a CPU
the kernel's reading of the bytes is replayed in torch (which code meets which x, the prmt floats); on a GPU the
kernel itself, every tile candidate, against the dequantized product and gemv.py's Triton kernel, and the int8
layer's one-row path through it."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import fasterllm.kernels

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


def _prmt(a: int, b: int, selector: int) -> int:
    """PTX's prmt.b32 d, a, b, selector (default mode): byte i of d is byte (selector >> 4i) & 7 of b:a."""
    source = (b << 32) | a
    return sum(((source >> (8 * ((selector >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))


def _kernel_asm() -> tuple[int, int, list[tuple[int, int]]]:
    """_codes_as_floats' xor mask, magic and (output, prmt selector) pairs, read from int8_gemv.py's source."""
    text = (Path(fasterllm.kernels.__file__).parent / "int8_gemv.py").read_text()
    asm = text[text.index("def _codes_as_floats"):text.index("def load_weight_chunk")]
    mask = int(re.search(r"xor\.b32 t, \$4, (0x[0-9A-Fa-f]+)", asm).group(1), 16)
    magic = int(re.search(r"mov\.b32 m, (0x[0-9A-Fa-f]+)", asm).group(1), 16)
    return mask, magic, [(int(o), int(c, 16)) for o, c in re.findall(r"prmt\.b32 \$(\d), t, m, (0x[0-9A-Fa-f]+)", asm)]


def test_kernel_reading_is_the_weights_product():
    """The kernel's own xor and byte permutes (emulated from its inline PTX), its pairing of output v_b with x's
    int64 word j (its low int32's two bf16, then its high one's), and the offset 2^23 + 128 give x @ codes^T: a wrong
    selector, mask or pairing is off by the size of the product."""
    mask, magic, permutes = _kernel_asm()
    assert sorted(output for output, _ in permutes) == [0, 1, 2, 3]
    n, k = 24, 64
    torch.manual_seed(1)
    codes = torch.randint(-128, 128, (n, k), dtype=torch.int8)
    x = torch.randn(1, k).to(torch.bfloat16)
    words = codes.view(torch.int32).flatten().tolist()
    x_words = x.view(torch.int64)[0]
    low, high = x_words.to(torch.int32), (x_words >> 32).to(torch.int32)
    xs = [(low << 16).view(torch.float32), (low & -65536).view(torch.float32),
          (high << 16).view(torch.float32), (high & -65536).view(torch.float32)]  # v0, v1, v2, v3's x
    out = torch.zeros(n)
    for output, selector in permutes:
        bits = [_prmt((w & 0xFFFFFFFF) ^ mask, magic, selector) for w in words]
        values = torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32).view(n, k // 4)
        out += ((values - 8388736.0) * xs[output]).sum(1)
    torch.testing.assert_close(out, (x.float() @ codes.float().t())[0], rtol=1e-6, atol=1e-4)


@gpu_only
@pytest.mark.parametrize("n,k", [(4096, 4096), (1000, 1040), (6144, 4096), (4096, 14336), (40, 16)])
def test_every_tile_matches_the_reference(n, k):
    from fasterllm.kernels.int8_gemv import CANDIDATES, int8_gemv
    codes, scales = int8_weight(n, k)
    x = torch.randn(1, k, device=DEVICE).to(torch.bfloat16)
    bias = torch.randn(n, device=DEVICE).to(torch.bfloat16)
    for b in (None, bias):
        want = reference(x, codes, scales, b)
        triton_kernel = gemv(x, codes, scales, b).float()
        for tile in CANDIDATES:
            got = int8_gemv(x, codes, scales, b, tile=tile).float()
            torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2, msg=f"tile {tile}")
            torch.testing.assert_close(got, triton_kernel, rtol=1e-2, atol=1e-2, msg=f"tile {tile} against gemv.py")


@gpu_only
def test_int8_rows_take_it_where_it_fits_and_gemv_elsewhere(monkeypatch):
    """weight_only_matmul's one row: the Gluon kernel for bf16 with K a multiple of 16 on Hopper and later, gemv.py's
    for other K and dtypes (and older GPUs); both give the product."""
    from fasterllm.kernels import int8_gemv as gluon_module
    from fasterllm.kernels import quant_weight_only
    ran = []

    def spy(module, name):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *args, **kwargs: ran.append(name) or real(*args, **kwargs))

    spy(gluon_module, "int8_gemv")
    spy(quant_weight_only, "gemv")
    hopper = torch.cuda.get_device_capability() >= (9, 0)
    for k, dtype in [(4096, torch.bfloat16), (1000, torch.bfloat16), (4096, torch.float16)]:
        codes, scales = int8_weight(512, k)
        x = torch.randn(1, k, device=DEVICE).to(dtype)
        ran.clear()
        torch.testing.assert_close(weight_only_matmul(x, codes, scales).float(), reference(x, codes, scales),
                                   rtol=1e-2, atol=1e-2)
        gluon = hopper and k % 16 == 0 and dtype == torch.bfloat16
        assert gluon_module.fits(x, codes) == (k % 16 == 0 and dtype == torch.bfloat16)
        assert ran == ["int8_gemv" if gluon else "gemv"], (k, dtype)
