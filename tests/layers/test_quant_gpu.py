"""The GPU quantized linears (layers/quantization/gpu.py) against the float linear: on a CPU their Triton kernels
run in the interpreter (fp8 is refused there, with the fix named); on a GPU at real shapes, fp8 included."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
from fasterllm.layers.quantization.gpu import (  # noqa: E402
    FP8Linear, Int4GPULinear, Int8GPULinear, W8A8GPULinear, check_fp8_device)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HOPPER = DEVICE.type == "cuda" and torch.cuda.get_device_capability()[0] >= 9
DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float16  # the interpreter's bf16 dot is wrong
# relative error of the output each format allows (random weights, std 0.05; activations N(0, 1))
FORMATS = {"int8": (Int8GPULinear.from_float, 0.015), "int4": (Int4GPULinear.from_float, 0.1),
           "w8a8": (W8A8GPULinear.from_float, 0.02)}
if HOPPER:
    FORMATS["fp8"] = (FP8Linear.from_float, 0.08)


def relative_error(make, tokens, n, k):
    torch.manual_seed(0)
    weight = (torch.randn(n, k, device=DEVICE) * 0.05).to(DTYPE)
    bias = torch.randn(n, device=DEVICE).to(DTYPE)
    x = torch.randn(2, tokens, k, device=DEVICE).to(DTYPE)  # leading dims are kept
    got = make(weight, bias)(x)
    assert got.shape == (2, tokens, n) and got.dtype == DTYPE and torch.isfinite(got).all()
    exact = F.linear(x.float(), weight.float(), bias.float())
    return ((got.float() - exact).norm() / exact.norm()).item()


@pytest.mark.parametrize("method", list(FORMATS))
# a decode row (split-K; tinygemm's kernel for bf16 int4 on a GPU), 32 rows (the tile kernel), more rows than a tile
@pytest.mark.parametrize("tokens", [1, 16, 40])
def test_close_to_the_float_linear(method, tokens):
    make, allowed = FORMATS[method]
    assert relative_error(make, tokens, 96, 576) <= allowed


@pytest.mark.skipif(DEVICE.type == "cuda", reason="the CPU refusal")
def test_fp8_is_refused_off_hopper_with_the_fix():
    with pytest.raises(ValueError, match="Hopper.*'int8'"):
        check_fp8_device(torch.device("cpu"))
    with pytest.raises(ValueError, match="Hopper"):
        FP8Linear.from_float(torch.randn(32, 32), None)


@pytest.mark.skipif(not HOPPER, reason="fp8 needs a Hopper GPU")
def test_fp8_refuses_widths_scaled_mm_cannot_take():
    with pytest.raises(ValueError, match="multiples of 16"):
        FP8Linear.from_float(torch.randn(40, 24, device=DEVICE, dtype=DTYPE), None)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="real model shapes need a GPU")
@pytest.mark.parametrize("method", list(FORMATS))
@pytest.mark.parametrize("tokens", [1, 64, 512])
def test_llama_8b_projection(method, tokens):
    make, allowed = FORMATS[method]
    assert relative_error(make, tokens, 6144, 4096) <= allowed


@pytest.mark.skipif(DEVICE.type != "cuda", reason="tinygemm's layout is chosen on a GPU")
def test_bf16_int4_on_a_gpu_keeps_tinygemms_layout():
    from fasterllm.kernels.quant_weight_only import tinygemm_kernel_available

    layer = Int4GPULinear.from_float(torch.randn(64, 256, device=DEVICE, dtype=torch.bfloat16), None)
    assert layer.tinygemm == tinygemm_kernel_available(DEVICE)
    assert layer.qweight.shape == ((8, 8, 32, 1) if layer.tinygemm else (64, 128))
    fp16 = Int4GPULinear.from_float(torch.randn(64, 256, device=DEVICE, dtype=torch.float16), None)
    assert not fp16.tinygemm and fp16.qweight.shape == (64, 128)


@pytest.mark.parametrize("group", [64, 128, 256])
@pytest.mark.parametrize("tokens", [1, 16, 40])
def test_int4_holds_a_checkpoints_wider_groups_and_multiplies_their_weight(group, tokens):
    """A GPTQ / AWQ checkpoint's groups of 64-256 stay that wide (a quarter of the scale bytes of 32 at 128) and the
    layer multiplies the weight they stand for, as closely as with the same scales repeated over groups of 32."""
    n, k = 64, 512
    generator = torch.Generator().manual_seed(group)
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=generator)
    scales = torch.rand(n, k // group, generator=generator) * 0.01 + 0.001
    minimums = -8 * scales + torch.randn(n, k // group, generator=generator) * 0.001
    repeat = lambda t: t.repeat_interleave(group, dim=1)  # noqa: E731
    weight = codes.float() * repeat(scales) + repeat(minimums)
    held = Int4GPULinear(codes.to(DEVICE), scales.to(DEVICE), minimums.to(DEVICE), None, DTYPE)
    as_32 = Int4GPULinear(codes.to(DEVICE), *(t.repeat_interleave(group // 32, dim=1).to(DEVICE)
                                              for t in (scales, minimums)), None, DTYPE)
    assert held.group_size == group and as_32.group_size == 32
    x = torch.randn(tokens, k, generator=generator).to(DEVICE, DTYPE)
    exact = x.float() @ weight.to(DEVICE).t()
    errors = [((layer(x).float() - exact).norm() / exact.norm()).item() for layer in (held, as_32)]
    assert errors[0] <= max(2 * errors[1], 1e-3) and errors[0] < 0.01


def test_int4_refuses_groups_it_does_not_hold():
    codes = torch.zeros(8, 384, dtype=torch.uint8, device=DEVICE)
    with pytest.raises(ValueError, match="need scales \\[8, 384 / group\\] with group one of \\(32, 64, 128, 256\\), "
                                         "got \\(8, 4\\)"):
        Int4GPULinear(codes, torch.ones(8, 4, device=DEVICE), torch.zeros(8, 4, device=DEVICE), None, DTYPE)
