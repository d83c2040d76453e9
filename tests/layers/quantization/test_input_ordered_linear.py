"""InputOrderedLinear (a GPTQ act-order projection: the device's grouped layer over the inputs sorted by group) against
the float product with the stored weight, for every int4 layer: torch's CPU kernel, our C++ one, and the GPU layer's
Triton kernels (in Triton's interpreter without a GPU; tinygemm's layout too on one); and for the uint8_grouped layers
(8-bit GPTQ in groups)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fasterllm.layers.quantization import STORED_LINEARS
from fasterllm.layers.quantization.int4 import Int4WeightOnlyLinear
from fasterllm.layers.quantization.stored import InputOrderedLinear, with_input_order
from fasterllm.layers.quantization.uint8_grouped import Uint8GroupedLinear

ROWS, INPUTS, GROUP = 48, 256, 32
GPU = torch.cuda.is_available()


def stored_int4(seed: int, bits: int = 4):
    """Random codes (of bits), scales and minimums of inputs sorted by group, the order (order[p]: the stored input
    that sorted input p is) and the float weight [N, K] in stored order."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2 ** bits, (ROWS, INPUTS), generator=g, dtype=torch.uint8)
    scales = (torch.rand(ROWS, INPUTS // GROUP, generator=g) * 0.02 + 0.005) / 2 ** (bits - 4)
    minimums = -2 ** (bits - 1) * scales + torch.randn(ROWS, INPUTS // GROUP, generator=g) * 0.01
    order = torch.randperm(INPUTS, generator=g)
    sorted_weight = codes.float() * scales.repeat_interleave(GROUP, 1) + minimums.repeat_interleave(GROUP, 1)
    weight = torch.empty_like(sorted_weight)
    weight[:, order] = sorted_weight
    return codes, scales, minimums, order, weight


def check_layer(make, device: torch.device, dtype: torch.dtype, tokens: int, allowed: float, bits: int = 4) -> None:
    codes, scales, minimums, order, weight = stored_int4(tokens, bits)
    bias = torch.randn(ROWS)
    layer = with_input_order(make(codes.to(device), scales.to(device), minimums.to(device), bias.to(device, dtype),
                                  dtype), order.to(device))
    assert isinstance(layer, InputOrderedLinear)
    x = torch.randn(tokens, INPUTS, generator=torch.Generator().manual_seed(1))
    got = layer(x.to(device, dtype)).float().cpu()
    exact = F.linear(x.to(dtype).float(), weight, bias.to(dtype).float())
    assert got.shape == (tokens, ROWS)
    assert ((got - exact).norm() / exact.norm()).item() <= allowed
    unordered = F.linear(x.to(dtype).float(), weight[:, order], bias.to(dtype).float())  # the order left out
    assert ((unordered - exact).norm() / exact.norm()).item() > 0.3


def test_the_identity_order_adds_no_layer():
    codes, scales, minimums, _, _ = stored_int4(0)
    layer = STORED_LINEARS["int4"]["cpu"](codes, scales, minimums, None, torch.float32)
    assert with_input_order(layer, torch.arange(INPUTS)) is layer


@pytest.mark.parametrize("tokens", [1, 7])
def test_on_torchs_cpu_kernel(tokens):
    check_layer(lambda *args: Int4WeightOnlyLinear(*args[:4], native=False), torch.device("cpu"), torch.float32,
                tokens, 0.01)  # bf16 activations


@pytest.mark.parametrize("tokens", [1, 7])
def test_on_our_cpu_kernel(tokens, cpu_kernels_on):
    check_layer(lambda *args: Int4WeightOnlyLinear(*args[:4], native=True), torch.device("cpu"), torch.float32,
                tokens, 1e-5)  # fp32 products


@pytest.mark.parametrize("dtype", [torch.float16] + ([torch.bfloat16] if GPU else []))
@pytest.mark.parametrize("tokens", [1, 16, 80])  # the matrix-vector kernel, the tile kernel, prefill
def test_on_the_gpu_layer(dtype, tokens):
    pytest.importorskip("triton")
    from fasterllm.layers.quantization.gpu import Int4GPULinear

    # without a GPU the Triton kernels run in the interpreter (conftest sets TRITON_INTERPRET), fp16 only there
    device = torch.device("cuda" if GPU else "cpu")
    check_layer(Int4GPULinear, device, dtype, tokens, 0.01)


@pytest.mark.parametrize("tokens", [1, 7])
def test_on_the_cpu_uint8_grouped_layer(tokens):
    check_layer(lambda *args: Uint8GroupedLinear(*args[:4]), torch.device("cpu"), torch.float32, tokens, 1e-5, bits=8)


@pytest.mark.parametrize("dtype", [torch.float16] + ([torch.bfloat16] if GPU else []))
@pytest.mark.parametrize("tokens", [1, 16, 80])
def test_on_the_gpu_uint8_grouped_layer(dtype, tokens):
    pytest.importorskip("triton")
    from fasterllm.layers.quantization.gpu import Uint8GroupedGPULinear

    check_layer(Uint8GroupedGPULinear, torch.device("cuda" if GPU else "cpu"), dtype, tokens, 0.01, bits=8)
