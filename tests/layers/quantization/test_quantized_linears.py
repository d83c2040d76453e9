"""Each quantized linear against its float reference on random inputs, within what its format rounds;
and which methods each device accepts."""
import pytest
import torch
from torch import nn

from fasterllm import LLM
from fasterllm.config import PREQUANTIZED_METHODS, QUANTIZATION_METHODS
from fasterllm.layers.quantization import QUANTIZED_LINEARS, STORED_LINEARS, check_supported
from fasterllm.layers.quantization.int4 import GROUP_SIZE, Int4WeightOnlyLinear, quantize_int4_grouped
from fasterllm.layers.quantization.int8 import Int8WeightOnlyLinear, quantize_int8_per_channel
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


def test_int4_rejects_a_width_its_groups_do_not_divide():
    with pytest.raises(ValueError, match="divisible by the group size 32, got 40"):
        Int4WeightOnlyLinear.from_float(torch.randn(8, 40), None)


def test_every_method_the_cli_and_config_name_has_layers():
    assert set(QUANTIZED_LINEARS) | set(PREQUANTIZED_METHODS) == set(QUANTIZATION_METHODS)
    assert set(STORED_LINEARS) == {"int4", *LAYOUTS.values()}  # every layout a stored checkpoint may have


def test_methods_are_refused_where_they_have_no_kernels():
    check_supported("int4", torch.device("cpu"))
    with pytest.raises(ValueError, match="quantization='fp8' has no CPU kernels .*Hopper.* use one of 'int8'"):
        check_supported("fp8", torch.device("cpu"))
    with pytest.raises(ValueError, match="quantization='int3' is not supported; supported: 'int8', 'int4'"):
        LLM(quantization="int3")
    with pytest.raises(ValueError, match="quantization='fp8' has no CPU kernels"):
        LLM(quantization="fp8", device="cpu")
