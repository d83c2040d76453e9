"""The weight-only int8 / int4 matmuls against torch on the dequantized weight: in Triton's interpreter on a CPU
(small shapes), natively on a GPU (the Llama-3-8B shapes)."""
from __future__ import annotations

import pytest
import torch

from fasterllm.layers.quantization.int4 import GROUP_SIZE, quantize_int4_grouped, scales_and_zeros
from fasterllm.layers.quantization.int8 import quantize_int8_per_channel

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytest.importorskip("triton")
from fasterllm.kernels.quant_weight_only import (  # noqa: E402
    FUSED_MAX_ROWS, TINYGEMM_MAX_ROWS, dequantize, dequantize_reference, dequantize_tinygemm, pack_int4_codes,
    pack_int4_tinygemm, tinygemm_matmul, tinygemm_reference, weight_only_matmul, weight_only_matmul_reference)

gpu_only = pytest.mark.skipif(DEVICE.type != "cuda", reason="real model shapes need a GPU")
# Triton 3.9's interpreter multiplies bf16 tiles wrongly (tl.dot): bf16 runs on a GPU only
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def quantized(method, n, k, seed=0):
    torch.manual_seed(seed)
    weight = torch.randn(n, k, device=DEVICE) * 0.05
    if method == "int8":
        return weight, quantize_int8_per_channel(weight) + (None,)
    codes, scales, minimums = quantize_int4_grouped(weight)
    return weight, (pack_int4_codes(codes), scales.half(), minimums.half())


def check(method, m, n, k, dtype, with_bias=True):
    weight, (qweight, scales, minimums) = quantized(method, n, k)
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    bias = torch.randn(n, device=DEVICE).to(dtype) if with_bias else None
    got = weight_only_matmul(x, qweight, scales, bias, minimums, GROUP_SIZE)
    expected = weight_only_matmul_reference(x, qweight, scales, bias, minimums, GROUP_SIZE)
    assert got.shape == (m, n) and got.dtype == dtype and torch.isfinite(got).all()
    scale = expected.float().abs().max().item()
    torch.testing.assert_close(got.float(), expected.float(), atol=TOLERANCE[dtype] * scale, rtol=0)
    # against the float weight: the format's own error, far from a wrong answer
    exact = x.float() @ weight.t() + (0 if bias is None else bias.float())
    assert (got.float() - exact).abs().max() <= (0.02 if method == "int8" else 0.15) * exact.abs().max()


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("dtype", DTYPES)
# one row (gemv.py; bf16 int8 on Hopper: int8_gemv.py, where K allows), a few, more than one 32-row tile (split K)
@pytest.mark.parametrize("m", [1, 5, 33])
def test_matches_dequantized_reference(method, dtype, m):
    check(method, m, 200, 576, dtype)  # 576 = SmolLM2's hidden: a partial K block and a partial N block


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_without_bias_and_with_large_m_fallback(method):
    check(method, 3, 64, 256, torch.float16, with_bias=False)
    check(method, FUSED_MAX_ROWS + 6, 96, 256, torch.float32)  # prefill: dequantize + torch matmul


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_matrix_vector_kernel_with_whole_chunks(method):
    check(method, 1, 40, 2048, torch.float32)  # K a multiple of gemv.py's chunk: the unmasked loads


def test_matrix_vector_kernel_on_float_weights():
    from fasterllm.kernels.gemv import gemv

    torch.manual_seed(0)
    weight, x, bias = torch.randn(40, 1000, device=DEVICE), torch.randn(1, 1000, device=DEVICE), torch.randn(40)
    torch.testing.assert_close(gemv(x, weight), x @ weight.t(), atol=1e-3, rtol=1e-4)  # no scales: W as it is
    torch.testing.assert_close(gemv(x, weight, bias=bias.to(DEVICE)), x @ weight.t() + bias.to(DEVICE), atol=1e-3,
                               rtol=1e-4)
    with pytest.raises(ValueError, match="one row"):
        gemv(torch.randn(2, 1000, device=DEVICE), weight)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_dequantize_kernel_is_exact(method):
    _, (qweight, scales, minimums) = quantized(method, 70, 320)
    got = dequantize(qweight, scales, minimums, GROUP_SIZE, torch.float32)
    assert torch.equal(got, dequantize_reference(qweight, scales, minimums, GROUP_SIZE))


def test_packing_keeps_every_code():
    codes = torch.randint(0, 16, (3, 64), dtype=torch.uint8)
    packed = pack_int4_codes(codes)
    assert packed.shape == (3, 32)
    ones = torch.ones(3, 2)
    assert torch.equal(dequantize_reference(packed, ones, torch.zeros(3, 2), 32), codes.float())


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_zero_rows_give_an_empty_result(method):
    _, (qweight, scales, minimums) = quantized(method, 64, 128)
    out = weight_only_matmul(torch.zeros(0, 128, device=DEVICE), qweight, scales, None, minimums, GROUP_SIZE)
    assert out.shape == (0, 64)


def test_mismatched_shapes_are_refused():
    _, (qweight, scales, _) = quantized("int8", 64, 128)
    with pytest.raises(ValueError, match="does not fit"):
        weight_only_matmul(torch.zeros(2, 96, device=DEVICE), qweight, scales)


@gpu_only
@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("m", [1, 16, 64, 256])
@pytest.mark.parametrize("n, k", [(4096, 4096), (2 * 14336, 4096), (4096, 14336)])
def test_llama_8b_shapes(method, m, n, k):
    check(method, m, n, k, torch.bfloat16)


@gpu_only
def test_replayed_from_a_cuda_graph_equals_eager():
    _, (qweight, scales, minimums) = quantized("int4", 4096, 4096)
    x = torch.randn(4, 4096, device=DEVICE, dtype=torch.bfloat16)
    eager = weight_only_matmul(x, qweight, scales, None, minimums, GROUP_SIZE)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = weight_only_matmul(x, qweight, scales, None, minimums, GROUP_SIZE)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert torch.equal(captured, weight_only_matmul(x, qweight, scales, None, minimums, GROUP_SIZE))
    assert not torch.equal(captured, eager)


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("m", [2, 17, 64])  # each row bucket of the tile table (16, 32, 64 rows)
def test_whole_tiles_take_the_unmasked_loads(method, m):
    check(method, m, 128, 512, torch.float32)


@pytest.mark.parametrize("n", [64, 72])  # whole output tiles (unmasked loads) and a partial one
@pytest.mark.parametrize("group_size,k", [(2, 512), (64, 512), (64, 576), (128, 640), (256, 768)])
def test_int4_group_sizes(group_size, k, n):
    torch.manual_seed(0)
    qweight = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=DEVICE)
    scales = (torch.rand(n, k // group_size, device=DEVICE) * 0.01).half()
    minimums = (torch.randn(n, k // group_size, device=DEVICE) * 0.05).half()
    for m in (1, 9, 40, FUSED_MAX_ROWS + 1):  # matrix-vector, both tile buckets, the dequantize path
        x = torch.randn(m, k, device=DEVICE)
        torch.testing.assert_close(weight_only_matmul(x, qweight, scales, None, minimums, group_size),
                                   weight_only_matmul_reference(x, qweight, scales, None, minimums, group_size),
                                   atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("group_size", [1, 48, 512])
def test_int4_group_size_must_be_a_power_of_two_up_to_256(group_size):
    _, (qweight, scales, minimums) = quantized("int4", 64, 1536)
    with pytest.raises(ValueError, match=f"group_size={group_size} must be a power of two from 2 to 256"):
        weight_only_matmul(torch.randn(3, 1536, device=DEVICE), qweight, scales, None, minimums, group_size)
    with pytest.raises(ValueError, match=f"group_size={group_size} must be a power of two"):
        dequantize(qweight, scales, minimums, group_size, torch.float32)


def tinygemm_weight(n, k, group_size, dtype, seed=0):
    """Random codes in tinygemm's layout, and the fp32 weight they stand for (scales and zeros as stored)."""
    torch.manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, device=DEVICE)
    scales = torch.rand(n, k // group_size, device=DEVICE) * 0.01
    minimums = torch.randn(n, k // group_size, device=DEVICE) * 0.05
    scale_zeros = scales_and_zeros(scales, minimums, dtype)
    return pack_int4_tinygemm(codes), scale_zeros, tinygemm_reference(codes, scale_zeros, group_size)


@pytest.mark.parametrize("n", [64, 72])  # whole output tiles and a partial one
@pytest.mark.parametrize("group_size,k", [(32, 576), (64, 576), (128, 640), (256, 768)])
def test_tinygemm_layout_matmul_and_dequantize(group_size, k, n):
    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
    packed, scale_zeros, weight = tinygemm_weight(n, k, group_size, dtype)
    # q s + (z - 8 s) in the kernel, (q - 8) s + z here: equal up to fp32 rounding
    torch.testing.assert_close(dequantize_tinygemm(packed, scale_zeros, group_size, torch.float32), weight,
                               atol=1e-6, rtol=1e-5)
    bias = torch.randn(n, device=DEVICE).to(dtype)
    # on a GPU the Gluon kernels (one row, 2-64 rows); in the interpreter both tile buckets; the dequantize path
    for m in (1, TINYGEMM_MAX_ROWS, 9, 40, FUSED_MAX_ROWS + 1):
        x = torch.randn(m, k, device=DEVICE).to(dtype)
        got = tinygemm_matmul(x, packed, scale_zeros, group_size, bias)
        expected = x.float() @ weight.t() + bias.float()
        assert got.shape == (m, n) and got.dtype == dtype
        torch.testing.assert_close(got.float(), expected, atol=TOLERANCE[dtype] * expected.abs().max().item(), rtol=0)


def test_tinygemm_layout_refuses_what_it_cannot_hold():
    with pytest.raises(ValueError, match="out_features % 8 == 0 and in_features % 32 == 0"):
        pack_int4_tinygemm(torch.zeros(12, 64, dtype=torch.uint8))
    packed, scale_zeros, _ = tinygemm_weight(16, 128, 32, torch.float32)
    with pytest.raises(ValueError, match="group_size=16 must be 32, 64, 128 or 256"):
        tinygemm_matmul(torch.randn(2, 128, device=DEVICE), packed, scale_zeros, 16)
    with pytest.raises(ValueError, match="does not fit the int4 weight"):
        tinygemm_matmul(torch.randn(2, 96, device=DEVICE), packed, scale_zeros, 32)
    with pytest.raises(ValueError, match="scale_zeros must be contiguous"):
        tinygemm_matmul(torch.randn(2, 128, device=DEVICE), packed, scale_zeros[:2], 32)


@gpu_only
def test_tinygemm_layout_is_torchs():
    """pack_int4_tinygemm makes the bytes torch's own packer makes (2 inner k tiles; it takes even k in the high
    nibble), so torch._weight_int4pack_mm reads ours."""
    codes = torch.randint(0, 16, (4096, 4096), dtype=torch.uint8, device=DEVICE)
    torch_packed = torch._convert_weight_to_int4pack(((codes[:, 0::2] << 4) | codes[:, 1::2]).contiguous(), 2)
    assert torch.equal(pack_int4_tinygemm(codes), torch_packed)


@gpu_only
@pytest.mark.parametrize("m", [1, 4, 16, 64, 256])
@pytest.mark.parametrize("n, k", [(4096, 4096), (2 * 14336, 4096), (4096, 14336)])
def test_tinygemm_layout_llama_8b_shapes(m, n, k):
    packed, scale_zeros, weight = tinygemm_weight(n, k, GROUP_SIZE, torch.bfloat16)
    x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
    expected = x.float() @ weight.t()
    got = tinygemm_matmul(x, packed, scale_zeros, GROUP_SIZE)
    torch.testing.assert_close(got.float(), expected, atol=TOLERANCE[torch.bfloat16] * expected.abs().max().item(),
                               rtol=0)


def uint8_grouped(n, k, group, seed=0):
    """Random 8-bit codes with fp32 scales of full mantissas (as Q6_K's d * sc: no fp16 holds them) and minimums."""
    torch.manual_seed(seed)
    codes = torch.randint(0, 256, (n, k), dtype=torch.uint8, device=DEVICE)
    scales = torch.rand(n, k // group, device=DEVICE) * 1e-3
    minimums = -128 * scales + torch.randn(n, k // group, device=DEVICE) * 0.01
    return codes, scales, minimums


def check_uint8_grouped(m, n, k, group, dtype, with_bias=True):
    codes, scales, minimums = uint8_grouped(n, k, group)
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    bias = torch.randn(n, device=DEVICE).to(dtype) if with_bias else None
    got = weight_only_matmul(x, codes, scales, bias, minimums, group, code_bits=8)
    expected = weight_only_matmul_reference(x, codes, scales, bias, minimums, group, code_bits=8)
    assert got.shape == (m, n) and got.dtype == dtype and torch.isfinite(got).all()
    scale = expected.float().abs().max().item()
    torch.testing.assert_close(got.float(), expected.float(), atol=TOLERANCE[dtype] * scale, rtol=0)
    # codes read one a byte: the reference over 4-bit reading of the same bytes is far off
    assert (got.float() - weight_only_matmul_reference(x, codes[:, : k // 2], scales, bias, minimums, group).float()
            ).abs().max() > 10 * TOLERANCE[dtype] * scale


@pytest.mark.parametrize("group", [16, 32])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 5, 33, FUSED_MAX_ROWS + 1])  # gemv.py, both tile buckets, dequantize + matmul
def test_uint8_grouped_matches_dequantized_reference(group, dtype, m):
    check_uint8_grouped(m, 72, 576, group, dtype)  # a partial K block and a partial N block


@pytest.mark.parametrize("group", [16, 32])
@pytest.mark.parametrize("m", [1, 2, 17, 64])
def test_uint8_grouped_whole_tiles_take_the_unmasked_loads(group, m):
    check_uint8_grouped(m, 128, 2048 if m == 1 else 512, group, torch.float32, with_bias=m != 2)


@pytest.mark.parametrize("group", [16, 32])
def test_uint8_grouped_dequantize_kernel_is_exact(group):
    """code * scale + minimum as the reference rounds it, up to the product's own rounding: full fp32 scales make
    code * scale inexact, which the reference rounds before the sum and a GPU's fused multiply-add does not (the
    interpreter keeps the two roundings; the two sums may then round apart by one unit of the result); fp16 scales
    (code * scale exact) give the reference's bits anywhere."""
    codes, scales, minimums = uint8_grouped(70, 320, group)
    reference = dequantize_reference(codes, scales, minimums, group, code_bits=8)
    got = dequantize(codes, scales, minimums, group, torch.float32, code_bits=8)
    products = dequantize_reference(codes, scales, torch.zeros_like(minimums), group, code_bits=8)
    assert ((got - reference).abs() <= products.abs() * 2 ** -24 + reference.abs() * 2 ** -23).all()
    half_scales, half_minimums = scales.half(), minimums.half()  # what the GPU layer keeps where fp16 is exact
    assert torch.equal(dequantize(codes, half_scales, half_minimums, group, torch.float32, code_bits=8),
                       dequantize_reference(codes, half_scales, half_minimums, group, code_bits=8))


def test_uint8_grouped_refuses_other_code_widths_and_shapes():
    codes, scales, minimums = uint8_grouped(64, 256, 16)
    with pytest.raises(ValueError, match="code_bits=6: grouped codes are 4 bits"):
        weight_only_matmul(torch.randn(2, 256, device=DEVICE), codes, scales, None, minimums, 16, code_bits=6)
    with pytest.raises(ValueError, match="does not fit the weight"):
        weight_only_matmul(torch.randn(2, 512, device=DEVICE), codes, scales, None, minimums, 16, code_bits=8)


@gpu_only
@pytest.mark.parametrize("group", [16, 32])
@pytest.mark.parametrize("m", [1, 16, 64, 256])
@pytest.mark.parametrize("n, k", [(4096, 4096), (2 * 14336, 4096), (4096, 14336)])
def test_uint8_grouped_llama_8b_shapes(group, m, n, k):
    check_uint8_grouped(m, n, k, group, torch.bfloat16)


@gpu_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_uint8_grouped_gpu_layer_keeps_scales_exact(dtype):
    """Q8_0-like scales (fp16 d, minimum -128 d) are kept in fp16, Q6_K-like ones in fp32: the layer's product is
    the reference's over the exact weight either way."""
    from fasterllm.layers.quantization.gpu import Uint8GroupedGPULinear

    codes, scales, minimums = uint8_grouped(512, 1024, 32)
    d = scales.half().float()
    for held_scales, held_minimums, kept in ((d, -128 * d, torch.float16), (scales, minimums, torch.float32)):
        layer = Uint8GroupedGPULinear(codes, held_scales, held_minimums, None, dtype)
        assert layer.scales.dtype == layer.minimums.dtype == kept
        for m in (1, 7, 100):
            x = torch.randn(m, 1024, device=DEVICE).to(dtype)
            expected = weight_only_matmul_reference(x, codes, held_scales, None, held_minimums, 32, code_bits=8)
            torch.testing.assert_close(layer(x).float(), expected.float(),
                                       atol=TOLERANCE[dtype] * expected.float().abs().max().item(), rtol=0)
