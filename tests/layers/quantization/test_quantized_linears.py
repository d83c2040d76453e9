"""Each quantized linear against its float reference on random inputs, within what its format rounds;
and which methods each device accepts."""
import pytest
import torch
from torch import nn

from fasterllm import LLM
from fasterllm.config import PREQUANTIZED_METHODS, QUANTIZATION_METHODS
from fasterllm.layers.quantization import QUANTIZED_LINEARS, STORED_LINEARS, check_supported
from fasterllm.layers.quantization.int4 import (GROUP_SIZE, Int4WeightOnlyLinear, held_group_size,
                                                quantize_int4_grouped)
from fasterllm.layers.quantization.int8 import Int8WeightOnlyLinear, quantize_int8_per_channel
from fasterllm.layers.quantization.uint8_grouped import GROUP_SIZES, Uint8GroupedLinear
from fasterllm.layers.quantization.w8a8 import W8A8Linear, quantize_per_token
from fasterllm.loader.compressed_tensors import LAYOUTS

IN, OUT, ROWS = 256, 96, 5


def float_layer(dtype):
    torch.manual_seed(0)
    layer = nn.Linear(IN, OUT, bias=True).to(dtype)
    return layer, torch.randn(ROWS, IN).to(dtype)


def assert_within(got, want, bound):
    assert torch.isfinite(got).all()  # a NaN fails here and in the comparison below
    assert ((got - want).abs() <= bound).all()
    assert not torch.equal(got, want)  # it really ran on the quantized weights


def dtype_rounding(want, dtype):
    return want.abs() * (2 ** -7 if dtype == torch.bfloat16 else 2 ** -20) + 1e-3


# torch's packed int8 / int4 CPU kernels multiply bf16 activations whatever the model's dtype (int8.py)
KERNEL_DTYPE = torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_is_off_by_at_most_half_a_step_per_weight(dtype):
    layer, x = float_layer(dtype)
    got, want = Int8WeightOnlyLinear.from_float(layer.weight, layer.bias)(x), layer(x).float()
    assert got.dtype == dtype
    _, scales = quantize_int8_per_channel(layer.weight)
    bound = x.float().abs().sum(dim=1, keepdim=True) * scales[None, :] / 2 + dtype_rounding(want, KERNEL_DTYPE)
    assert_within(got.float(), want, bound)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_is_off_by_at_most_half_a_step_per_weight_of_its_group(dtype):
    layer, x = float_layer(dtype)
    got, want = Int4WeightOnlyLinear.from_float(layer.weight, layer.bias)(x), layer(x).float()
    assert got.dtype == dtype
    _, scales, minimums = quantize_int4_grouped(layer.weight)
    x_per_group = x.float().abs().reshape(ROWS, IN // GROUP_SIZE, GROUP_SIZE).sum(dim=2)
    bound = x_per_group @ (scales / 2).t() + dtype_rounding(want, KERNEL_DTYPE)
    bound += x_per_group @ ((minimums.abs() + 16 * scales) * 2 ** -8).t()  # scale and offset held in bf16
    assert_within(got.float(), want, bound)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w8a8_is_off_by_the_weight_and_the_activation_steps(dtype):
    layer, x = float_layer(dtype)
    got, want = W8A8Linear.from_float(layer.weight, layer.bias)(x).float(), layer(x).float()
    qweight, w_scales = quantize_int8_per_channel(layer.weight)
    _, x_scales = quantize_per_token(x)
    # x w - x~ w~ = x (w - w~) + (x - x~) w~
    bound = (x.float().abs().sum(dim=1, keepdim=True) * w_scales[None, :] / 2
             + x_scales / 2 * (qweight.float().abs() * w_scales[:, None]).sum(dim=1)[None, :]
             + dtype_rounding(want, dtype))
    assert_within(got, want, bound)


@pytest.mark.parametrize("group_size, inputs, held", [(32, 4096, 32), (128, 4096, 128), (384, 4608, 128),
                                                      (512, 4096, 256), (-1, 576, 64), (-1, 11008, 256),
                                                      (0, 64, 64)])
def test_int4_holds_a_checkpoints_groups_as_wide_as_its_kernels_read(group_size, inputs, held):
    """A checkpoint's groups of 32-256 stay as they are; wider ones and whole rows (-1 GPTQ, 0 compressed-tensors)
    become the widest of 32-256 that divides them, with the same scale repeated."""
    assert held_group_size(group_size, inputs) == held


def test_int4_refuses_whole_rows_it_cannot_group():
    with pytest.raises(ValueError, match="a projection of 1000 inputs quantized per row .* quantization='int8'"):
        held_group_size(-1, 1000)


def test_int4_rejects_a_width_its_groups_do_not_divide():
    with pytest.raises(ValueError, match="divisible by the group size 32, got 40"):
        Int4WeightOnlyLinear.from_float(torch.randn(8, 40), None)


def uint8_grouped_weight(n, k, group, seed=0):
    """Random codes 0..255 with scales and minimums as Q6_K makes them (an fp16 times an int8 sub-scale: 19-bit
    mantissas, exact in fp32 only), and the fp32 weight they stand for."""
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=generator)
    d = (torch.rand(n, k // 256 if k >= 256 else 1, generator=generator) * 1e-3).half().float()
    sub = torch.randint(-128, 128, (n, k // group), generator=generator).float()
    scales = d.repeat_interleave(k // group // d.shape[1], dim=1) * sub
    minimums = -32 * scales + torch.randn(n, k // group, generator=generator) * 0.01
    weight = codes.float() * scales.repeat_interleave(group, dim=1) + minimums.repeat_interleave(group, dim=1)
    return (codes, scales, minimums), weight


@pytest.mark.parametrize("group", GROUP_SIZES)
@pytest.mark.parametrize("rows", [1, 5, 300])
def test_uint8_grouped_multiplies_exactly_the_weight_its_codes_stand_for(group, rows):
    """torch's path (the C++ kernel's own tests: tests/kernels/test_cpu_gemv.py). fp32: the same products as F.linear
    over the fp32 weight (only the order of the sums differs), in blocks of output rows (N larger than one block) as
    in one; bf16: the weight rounded once to bf16."""
    torch.manual_seed(0)
    (codes, scales, minimums), weight = uint8_grouped_weight(2100, 512, group)
    assert not torch.equal(scales, scales.bfloat16().float())  # bf16 (or fp16) scales would round them
    bias = torch.randn(2100)
    layer = Uint8GroupedLinear(codes, scales, minimums, bias, native=False)
    assert layer.rows_per_block(rows) < 2100 or rows > 16  # few rows: blocks of rows; many: one block here
    assert layer.group_size == group
    x = torch.randn(rows, 512)
    want = x.double() @ weight.double().t() + bias.double()
    got = layer(x)
    assert got.dtype == torch.float32 and got.shape == (rows, 2100)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    got = Uint8GroupedLinear(codes, scales, minimums, bias.bfloat16(), native=False)(x.bfloat16())  # bf16 bias
    assert got.dtype == torch.bfloat16
    want = (x.bfloat16().float() @ weight.bfloat16().float().t() + bias.bfloat16().float())
    torch.testing.assert_close(got.float(), want, rtol=2 ** -7, atol=2 ** -7 * want.abs().max().item())
    assert not torch.equal(layer(x)[:, :1], layer(x + 1)[:, :1])  # it reads x


def test_uint8_grouped_refuses_what_it_cannot_hold():
    (codes, scales, minimums), _ = uint8_grouped_weight(4, 256, 32)
    with pytest.raises(ValueError, match="group one of \\(16, 32\\); got torch.uint8 codes \\(4, 256\\), "
                                         "scales \\(4, 4\\)"):
        Uint8GroupedLinear(codes, scales[:, :4], minimums[:, :4], None)
    with pytest.raises(ValueError, match="got torch.int8 codes"):
        Uint8GroupedLinear(codes.to(torch.int8), scales, minimums, None)


def test_every_method_the_cli_and_config_name_has_layers():
    assert set(QUANTIZED_LINEARS) | set(PREQUANTIZED_METHODS) == set(QUANTIZATION_METHODS)
    # every layout a stored checkpoint may have, and the 8-bit codes of a GGUF's Q5_K / Q6_K / Q8_0 blocks
    assert set(STORED_LINEARS) == {"int4", "uint8_grouped", *LAYOUTS.values()}


def test_methods_are_refused_where_they_have_no_kernels():
    check_supported("int4", torch.device("cpu"))
    with pytest.raises(ValueError, match="quantization='fp8' has no CPU kernels .*Hopper.* use one of 'int8'"):
        check_supported("fp8", torch.device("cpu"))
    with pytest.raises(ValueError, match="quantization='int3' is not supported; supported: 'int8', 'int4'"):
        LLM(quantization="int3")
    with pytest.raises(ValueError, match="quantization='fp8' has no CPU kernels"):
        LLM(quantization="fp8", device="cpu")
