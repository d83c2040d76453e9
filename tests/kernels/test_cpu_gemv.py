"""Our C++ CPU matrix-vector kernels (kernels/native/cpu_gemv.py) against exact products of the same quantized
weights and against the torch path of the int4 / int8 layers, for each ISA this CPU runs (so an AVX-512 machine
tests the AVX2 code too): odd shapes, 1 to 33 input rows (every group size of the kernels' passes), fp32 and bf16
inputs. The kernels multiply the inputs as they come (fp32 FMAs), so they must come within fp32 summation error of the
exact product; rounding the inputs (to int8 per block, or to bf16) misses that bound by orders of magnitude.
Skipped only where no C++ compiler exists (then the layers run torch's kernels, which their own tests cover)."""
import os
import shutil

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from fasterllm.kernels.native import cpu_extension, cpu_gemv
from fasterllm.layers import linear
from fasterllm.layers.quantization.int4 import GROUP_SIZE, Int4WeightOnlyLinear, quantize_int4_grouped
from fasterllm.layers.quantization.int8 import Int8WeightOnlyLinear, quantize_int8_per_channel
from fasterllm.layers.quantization.uint8_grouped import Uint8GroupedLinear, dequantize_uint8_grouped
from fasterllm.loader.gguf_blocks import block_layout, unpack_blocks
from gguf_random_blocks import random_blocks

if shutil.which(os.environ.get("CXX", "c++")) is None:
    pytest.skip("no C++ compiler: the C++ CPU kernels cannot be built here", allow_module_level=True)

ISAS = [pytest.param(isa, marks=pytest.mark.skipif(isa not in cpu_extension.supported_isas(),
                                                   reason=f"this CPU cannot run the {isa} kernels"))
        for isa in cpu_extension.ISA_FLAGS]
needs_avx2 = pytest.mark.skipif("avx2" not in cpu_extension.supported_isas(),
                                reason="this CPU cannot run the avx2 kernels")
# N not a multiple of 8 or 16, K a multiple of 32 but not of 64 (an odd number of blocks), and SmolLM2's shapes
SHAPES = [(1, 32), (17, 96), (77, 160), (40, 1536), (960, 576)]
# passes over a tile take up to 8 rows (AVX-512), 4 (AVX2 int8) or 2 (AVX2 int4), the rest in groups of 4, 2, 1
ROWS = [1, 2, 3, 6, 13, 33]
# fp32 sums of up to 1536 products in a few chains: measured at most 2^-20.8 (int8) and 2^-23 (int4) of the sum of
# the products' magnitudes over these cases, on both ISAs; with the inputs rounded to bf16, up to 2^-9
SUMMATION_ERROR = 2 ** -18


@pytest.fixture(scope="module", autouse=True)
def built():
    assert cpu_extension.load(), "a compiler is present, yet the extension did not build (see the warning logged)"


def activations(rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    x = torch.randn(rows, width)
    x[:, 5] *= 30  # an outlier channel, as real activations have
    return x.to(dtype)


def assert_within_summation_error(got, x, terms, magnitudes):
    """got (in x's dtype, rounded once there) within fp32 summation error of the exact product x @ terms.T, whose
    products' magnitudes add up to magnitudes [M, N]."""
    exact = x.double() @ terms.t()
    assert got.dtype == x.dtype and got.shape == exact.shape
    bound = SUMMATION_ERROR * magnitudes
    if x.dtype == torch.bfloat16:
        bound = bound + exact.abs() * 2 ** -8  # the output rounded to bf16
    error = (got.double() - exact).abs()
    assert (error <= bound).all(), (error / magnitudes).max().item()


def int4_weights(n, k, source):
    """Codes, scales and minimums of a random [n, k] weight, from our quantizer ("int4": fp32 scales and minimums,
    which pack_int4 keeps in fp32) or from GGUF Q4_1 blocks ("Q4_1": fp16 ones, which it keeps in fp16), with the
    dtype pack_int4 must hold them in."""
    weight = torch.randn(n, k)
    if source == "int4":
        return (*quantize_int4_grouped(weight), torch.float32)
    return (*unpack_blocks(quants.quantize(weight.numpy(), GGMLQuantizationType.Q4_1), "Q4_1", (n, k)), torch.float16)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("source", ["int4", "Q4_1"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, k", SHAPES)
def test_int4_is_the_exact_product_within_fp32_summation(isa, source, dtype, n, k):
    torch.manual_seed(n * k)
    codes, scales, minimums, held_in = int4_weights(n, k, source)
    packed = cpu_gemv.pack_int4(codes, scales, minimums)
    assert packed.scales.dtype == packed.minimums.dtype == held_in
    groups = codes.double().reshape(n, k // GROUP_SIZE, GROUP_SIZE)
    scaled = groups * scales.double()[..., None]
    weight = (scaled + minimums.double()[..., None]).reshape(n, k)
    # the kernels add scale x sum(code x) and minimum x sum(x) per group: those are the terms that round
    term_sizes = (scaled.abs() + minimums.double().abs()[..., None]).reshape(n, k)
    for rows in ROWS:
        x = activations(rows, k, dtype)
        got = cpu_gemv.int4_gemv(x, packed, isa)
        assert_within_summation_error(got, x, weight, x.double().abs() @ term_sizes.t())


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, k", SHAPES)
def test_int8_is_the_exact_product_within_fp32_summation(isa, dtype, n, k):
    torch.manual_seed(n * k)
    qweight, scales = quantize_int8_per_channel(torch.randn(n, k))
    packed = cpu_gemv.pack_int8(qweight, scales)
    weight = qweight.double() * scales.double()[:, None]
    for rows in ROWS:
        x = activations(rows, k, dtype)
        got = cpu_gemv.int8_gemv(x, packed, isa)
        assert_within_summation_error(got, x, weight, x.double().abs() @ weight.abs().t())


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("n, k", SHAPES)
def test_float_is_the_exact_product_within_fp32_summation(isa, n, k):
    """fp32 weights (layers/linear.TiledCPULinear's), with and without a bias added to each row's sum."""
    torch.manual_seed(n * k)
    weight, bias = torch.randn(n, k), torch.randn(n)
    packed = cpu_gemv.pack_float(weight)
    assert packed.weight.dtype == torch.float32 and packed.weight.shape == (-(-n // 16), k // 32, 512)
    for rows in ROWS:
        x = activations(rows, k, torch.float32)
        magnitudes = x.double().abs() @ weight.double().abs().t()
        assert_within_summation_error(cpu_gemv.float_gemv(x, packed, None, isa), x, weight.double(), magnitudes)
        got = cpu_gemv.float_gemv(x, packed, bias, isa) - bias  # the bias added once, after the sum
        assert_within_summation_error(got, x, weight.double(), magnitudes + bias.double().abs())


def uint8_grouped(n, k, group):
    """Random 8-bit codes with scales as a GGUF Q6_K makes them (an fp16 d times an int8 sub-scale: 19-bit mantissas,
    whose products with a code fp32 holds exactly) and minimums (-128 scale and off it), per group of group inputs."""
    codes = torch.randint(0, 256, (n, k), dtype=torch.uint8)
    scales = (torch.rand(n, 1) * 1e-5).half().float() * torch.randint(-128, 128, (n, k // group)).float()
    minimums = -128 * scales + torch.randn(n, k // group) * 1e-2
    return codes, scales, minimums


def uint8_grouped_weights(n, k, group, source):
    """Codes, scales and minimums per group of group inputs, random as uint8_grouped's ("random": fp32 ones, which
    pack_uint8_grouped keeps in fp32) or from GGUF Q8_0 blocks ("Q8_0": d and -128 d, which it keeps in fp16; groups
    of 16 as in a projection fused with Q6_K parts), with the dtype pack_uint8_grouped must hold them in."""
    if source == "random":
        return (*uint8_grouped(n, k, group), torch.float32)
    raw = quants.quantize(torch.randn(n, k).numpy(), GGMLQuantizationType.Q8_0)
    return (*unpack_blocks(raw, "Q8_0", (n, k), group), torch.float16)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("source", ["random", "Q8_0"])
@pytest.mark.parametrize("group", [16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, k", SHAPES)
def test_uint8_grouped_is_the_exact_product_within_fp32_summation(isa, source, group, dtype, n, k):
    torch.manual_seed(n * k + group)
    codes, scales, minimums, held_in = uint8_grouped_weights(n, k, group, source)
    packed = cpu_gemv.pack_uint8_grouped(codes, scales, minimums)
    assert packed.scales.dtype == packed.minimums.dtype == held_in
    groups = codes.double().reshape(n, k // group, group)
    scaled = groups * scales.double()[..., None]
    weight = (scaled + minimums.double()[..., None]).reshape(n, k)
    assert torch.equal(weight.float(), dequantize_uint8_grouped(codes, scales, minimums))  # exact in fp32
    # the kernels add scale x sum(code x) and minimum x sum(x) per group: those are the terms that round
    term_sizes = (scaled.abs() + minimums.double().abs()[..., None]).reshape(n, k)
    as_fp32 = packed._replace(scales=packed.scales.float(), minimums=packed.minimums.float())
    for rows in ROWS:
        x = activations(rows, k, dtype)
        got = cpu_gemv.uint8_grouped_gemv(x, packed, isa)
        assert_within_summation_error(got, x, weight, x.double().abs() @ term_sizes.t())
        assert torch.equal(got, cpu_gemv.uint8_grouped_gemv(x, as_fp32, isa))  # fp16 widened exactly: the same sums


# the dtype pack_int4 (Q4_*) or pack_uint8_grouped holds each GGUF type's scales and minimums in
HELD_IN = {"Q4_0": torch.float16, "Q4_1": torch.float16, "Q8_0": torch.float16, "Q4_K": torch.float32,
           "Q5_K": torch.float32, "Q6_K": torch.float32}


@pytest.mark.parametrize("kind", list(HELD_IN))
def test_scales_and_minimums_are_fp16_only_where_fp16_holds_them_all(kind):
    """pack_int4 and pack_uint8_grouped hold a layer's scales and minimums in fp16 where every one is exact there
    (GGUF Q4_0 / Q4_1 / Q8_0: fp16 d, and -8 d or -128 d), else in fp32 (the k-quants: d times a 6- or 8-bit
    sub-scale; one value off fp16's grid or out of its range is enough): they never round them."""
    rows, cols = 20, 256
    rng = np.random.default_rng(0)
    if kind in ("Q4_0", "Q4_1", "Q8_0"):  # gguf's own quantizer
        raw = quants.quantize(rng.standard_normal((rows, cols), dtype=np.float32), GGMLQuantizationType[kind])
    else:  # gguf has none for the k-quants: random blocks of weights about 1
        raw = random_blocks(kind, rows, cols, rng, magnitude=1.0)
    codes, scales, minimums = unpack_blocks(raw, kind, (rows, cols))
    pack = cpu_gemv.pack_int4 if block_layout((kind,)).layout == "int4" else cpu_gemv.pack_uint8_grouped
    groups = scales.shape[1]

    def unpacked(values):  # [2 tiles, groups, 16] -> [rows, groups]
        return values.float().transpose(1, 2).reshape(32, groups)[:rows]

    packed = pack(codes, scales, minimums)
    assert packed.scales.dtype == packed.minimums.dtype == HELD_IN[kind]
    assert packed.scales.nbytes == packed.minimums.nbytes == 2 * groups * 16 * HELD_IN[kind].itemsize
    assert torch.equal(unpacked(packed.scales), scales) and torch.equal(unpacked(packed.minimums), minimums)
    off_grid = scales.clone()
    off_grid[3, 1] *= 1 + 2 ** -12  # between two fp16 values
    out_of_range = minimums.clone()
    out_of_range[0, 0] = -1e5  # past fp16's largest
    for changed in ((codes, off_grid, minimums), (codes, scales, out_of_range)):
        packed = pack(*changed)
        assert packed.scales.dtype == packed.minimums.dtype == torch.float32
        assert torch.equal(unpacked(packed.scales), changed[1]) and torch.equal(unpacked(packed.minimums), changed[2])


def test_rounding_the_inputs_misses_the_bound():
    """The bound above can fail: the same products with the inputs rounded to bf16 (what torch's packed kernels
    do) exceed it."""
    torch.manual_seed(0)
    qweight, scales = quantize_int8_per_channel(torch.randn(960, 576))
    packed = cpu_gemv.pack_int8(qweight, scales)
    weight = qweight.double() * scales.double()[:, None]
    x = activations(3, 576, torch.float32)
    rounded = cpu_gemv.int8_gemv(x.bfloat16().float(), packed, cpu_extension.supported_isas()[-1])
    with pytest.raises(AssertionError):
        assert_within_summation_error(rounded, x, weight, x.double().abs() @ weight.abs().t())


def relative_error(got, want):
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layers_agree_with_their_torch_path(isa, dtype, monkeypatch):
    """The int4 and int8 layers on our kernel against the same layers on torch's (bf16 activations there; its int4
    kernel needs N divisible by 16)."""
    monkeypatch.setattr(cpu_gemv, "kernel_isa", lambda: isa)
    torch.manual_seed(0)
    weight, bias = torch.randn(80, 160), torch.randn(80)
    int4 = quantize_int4_grouped(weight)
    int8 = quantize_int8_per_channel(weight)
    for rows in (1, 5, 40):
        x = activations(rows, 160, dtype)
        for ours, theirs in ((Int4WeightOnlyLinear(*int4, bias.to(dtype), native=True),
                              Int4WeightOnlyLinear(*int4, bias.to(dtype), native=False)),
                             (Int8WeightOnlyLinear(*int8, bias.to(dtype), native=True),
                              Int8WeightOnlyLinear(*int8, bias.to(dtype), native=False))):
            got, want = ours(x), theirs(x)
            assert ours.native is not None and theirs.native is None and got.dtype == dtype
            assert relative_error(got, want) < 0.02
        for group in (16, 32):  # no rounding on either path: fp32 within summation, bf16 within its output rounding
            codes, scales, minimums = uint8_grouped(80, 160, group)
            ours = Uint8GroupedLinear(codes, scales, minimums, bias.to(dtype), native=True)
            theirs = Uint8GroupedLinear(codes, scales, minimums, bias.to(dtype), native=False)
            got, want = ours(x), theirs(x)
            assert ours.native is not None and theirs.native is None and got.dtype == dtype
            assert relative_error(got, want) < (1e-5 if dtype == torch.float32 else 0.02)


def test_fp32_linears_take_the_tiles_where_they_fit():
    """cpu_linear: fp32 weights with K a multiple of 32 go to our product (any leading dims of the input kept); bf16
    weights and other widths stay on oneDNN's packed layer."""
    torch.manual_seed(0)
    weight, bias = torch.randn(24, 64), torch.randn(24)
    tiled = linear.cpu_linear(weight, bias)
    assert type(tiled) is linear.TiledCPULinear and tiled.out_features == 24
    x = torch.randn(2, 3, 64)
    want = torch.nn.functional.linear(x.double(), weight.double(), bias.double())
    assert tiled(x).shape == (2, 3, 24) and torch.allclose(tiled(x).double(), want, rtol=1e-5, atol=1e-5)
    cpu = torch.device("cpu")
    if linear.can_pack(cpu, torch.float32):
        assert type(linear.cpu_linear(weight[:, :48], bias)) is linear.PackedCPULinear
    if linear.can_pack(cpu, torch.bfloat16):
        assert type(linear.cpu_linear(weight.bfloat16(), bias.bfloat16())) is linear.PackedCPULinear


def test_int8_layer_keeps_torch_for_widths_the_kernel_cannot_take():
    # 48: not a multiple of 32 (torch 2.13's _weight_int8pack_mm crashes at K=40 on AVX-512, so not 40)
    qweight, scales = quantize_int8_per_channel(torch.randn(8, 48))
    layer = Int8WeightOnlyLinear(qweight, scales, None, native=True)
    assert layer.native is None
    assert layer(torch.randn(2, 48)).shape == (2, 8)


def test_bad_inputs_are_refused_with_what_was_given():
    codes, scales, minimums = quantize_int4_grouped(torch.randn(16, 64))
    packed = cpu_gemv.pack_int4(codes, scales, minimums)
    with pytest.raises(RuntimeError, match=r"input must be \[rows, 64\], got \[1, 32\]"):
        cpu_gemv.int4_gemv(torch.randn(1, 32), packed, "avx2")
    with pytest.raises(RuntimeError, match="input must be float32 or bfloat16, got Half"):
        cpu_gemv.int4_gemv(torch.randn(1, 64).half(), packed, "avx2")
    int8 = cpu_gemv.pack_int8(torch.zeros(20, 64, dtype=torch.int8), torch.ones(20))
    with pytest.raises(RuntimeError, match="isa must be 'avx2' or 'avx512', got 'sse2'"):
        cpu_gemv.int8_gemv(torch.randn(1, 64), int8, "sse2")
    with pytest.raises(RuntimeError, match=r"scales must be a contiguous CPU Float tensor of shape \[2, 16\]"):
        cpu_gemv.int8_gemv(torch.randn(1, 64), int8._replace(scales=torch.ones(2, 8)), "avx2")
    with pytest.raises(RuntimeError, match="N = 40 does not fit 2 tiles of 16 rows"):
        cpu_gemv.int8_gemv(torch.randn(1, 64), int8._replace(rows=40), "avx2")
    with pytest.raises(ValueError, match="divisible by 32, got 40"):
        cpu_gemv.pack_int4(torch.zeros(4, 40, dtype=torch.uint8), torch.ones(4, 1), torch.zeros(4, 1))
    grouped = cpu_gemv.pack_uint8_grouped(*uint8_grouped(20, 64, 16))
    with pytest.raises(RuntimeError, match=r"scales must be \[N/16, K/16 or K/32, 16\]"):
        cpu_gemv.uint8_grouped_gemv(torch.randn(1, 64), grouped._replace(scales=torch.ones(2, 3, 16)), "avx2")
    with pytest.raises(ValueError, match="groups of 16 or 32 inputs, got 64 inputs in 1 groups"):
        cpu_gemv.pack_uint8_grouped(*uint8_grouped(4, 64, 64))
    floats = cpu_gemv.pack_float(torch.randn(20, 64))
    with pytest.raises(RuntimeError, match=r"input must be a float32 CPU tensor \[rows, 64\], got BFloat16"):
        cpu_gemv.float_gemv(torch.randn(1, 64).bfloat16(), floats, None, "avx2")
    with pytest.raises(RuntimeError, match=r"bias must be a contiguous CPU Float tensor of shape \[20\]"):
        cpu_gemv.float_gemv(torch.randn(1, 64), floats, torch.ones(16), "avx2")


@pytest.mark.parametrize("value, answer", [("avx2", "avx2"), ("off", None), ("", "widest"), ("auto", "widest")])
def test_the_isa_follows_the_cpu_and_the_override(value, answer, monkeypatch):
    monkeypatch.setenv(cpu_extension.ISA_ENV, value)
    cpu_extension.kernel_isa.cache_clear()
    try:
        assert cpu_extension.kernel_isa() == (cpu_extension.supported_isas()[0] if answer == "widest" else answer)
    finally:
        monkeypatch.undo()
        cpu_extension.kernel_isa.cache_clear()


def test_a_bad_override_names_the_value_and_the_choices(monkeypatch):
    monkeypatch.setenv(cpu_extension.ISA_ENV, "avx1024")
    cpu_extension.kernel_isa.cache_clear()
    try:
        with pytest.raises(ValueError, match=r"FASTERLLM_CPU_KERNELS='avx1024' is not one of 'auto', 'avx512', 'avx2', 'off'"):
            cpu_extension.kernel_isa()
    finally:
        monkeypatch.undo()
        cpu_extension.kernel_isa.cache_clear()


@needs_avx2
@pytest.mark.parametrize("source", ["int4", "Q4_1"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, k", SHAPES)
def test_int4_with_int8_inputs_is_the_exact_product_of_the_quantized_inputs(source, dtype, n, k):
    """FASTERLLM_CPU_INT4_INPUTS=int8: the inputs quantized per block of 32 (quantize_rows_int8, the reference), the
    codes times those integers summed exactly, each group's scale times the block's input scale, plus the minimum times
    the block's exact input sum: within fp32 rounding of that, for every pass size of the AVX2 kernel."""
    torch.manual_seed(n * k)
    codes, scales, minimums, held_in = int4_weights(n, k, source)
    packed = cpu_gemv.pack_int4(codes, scales, minimums)
    assert packed.scales.dtype == held_in
    groups = codes.double().reshape(n, k // GROUP_SIZE, GROUP_SIZE)
    for rows in ROWS:
        x = activations(rows, k, dtype)
        values, input_scales = cpu_gemv.quantize_rows_int8(x)
        # [rows, n, groups]: each group's sum of code x quantized input, exact in float64
        sums = torch.einsum("ngj,rgj->rng", groups, values.double().reshape(rows, k // GROUP_SIZE, GROUP_SIZE))
        exact = ((sums * scales.double() * input_scales.double()[:, None, :]).sum(-1)
                 + x.double().reshape(rows, -1, GROUP_SIZE).sum(-1) @ minimums.double().t())
        got = cpu_gemv.int4_gemv(x, packed, "avx2", int8_inputs=True)
        magnitudes = ((sums.abs() * scales.double() * input_scales.double()[:, None, :]).sum(-1)
                      + x.double().reshape(rows, -1, GROUP_SIZE).abs().sum(-1) @ minimums.double().abs().t())
        bound = SUMMATION_ERROR * magnitudes + (exact.abs() * 2 ** -8 if dtype == torch.bfloat16 else 0)
        assert got.dtype == dtype and ((got.double() - exact).abs() <= bound).all(), rows
        # and it is not the fp32 inputs' product: the inputs were rounded
        assert not torch.equal(got, cpu_gemv.int4_gemv(x, packed, "avx2"))


@needs_avx2
def test_int4_with_int8_inputs_does_not_overflow_at_the_largest_codes_and_inputs():
    """The kernel sums a block's 32 products of a code (up to 15) and an input (up to 127 in magnitude) in int16
    pairs: all codes 15 and every input the block's largest (each one +127 or -127) is the largest such sum."""
    n, k = 32, 96
    codes = torch.full((n, k), 15, dtype=torch.uint8)
    scales, minimums = torch.full((n, k // GROUP_SIZE), 0.5), torch.zeros(n, k // GROUP_SIZE)
    packed = cpu_gemv.pack_int4(codes, scales, minimums)
    for sign in (1.0, -1.0):
        x = torch.full((1, k), 3.0 * sign)
        got = cpu_gemv.int4_gemv(x, packed, "avx2", int8_inputs=True)
        # every input quantizes to exactly +-127 with scale 3 / 127: the product is exact
        assert torch.allclose(got, torch.full((1, n), sign * 15 * 0.5 * 3.0 * k), rtol=1e-6), got[0, :4]


@needs_avx2
def test_int8_inputs_round_halves_to_even_as_the_reference():
    """Inputs at x * 127 / max |x| = n + 1/2 (max |x| = 127: the factor is 1) quantize to the even neighbour in the
    kernel as in quantize_rows_int8: a value off by one would move the product by a whole weight, far past the
    bound."""
    block = torch.cat([torch.tensor([127.0]), torch.arange(-16, 15) + 0.5])
    x = torch.stack([block.repeat(3), -block.repeat(3)])
    torch.manual_seed(5)
    codes, scales, minimums = quantize_int4_grouped(torch.randn(32, 96))
    values, input_scales = cpu_gemv.quantize_rows_int8(x)
    assert (input_scales == 1).all() and values[0, 1:5].tolist() == [-16, -14, -14, -12]  # -15.5 ... -12.5
    scaled = (codes.double().reshape(32, 3, 32) * scales.double()[..., None]).reshape(32, 96)
    exact = values.double() @ scaled.t() + x.double().reshape(2, 3, 32).sum(-1) @ minimums.double().t()
    got = cpu_gemv.int4_gemv(x, cpu_gemv.pack_int4(codes, scales, minimums), "avx2", int8_inputs=True)
    assert ((got.double() - exact).abs() <= 1e-4 * exact.abs().max()).all()


@needs_avx2
def test_the_int4_layer_follows_the_inputs_switch(monkeypatch):
    """FASTERLLM_CPU_INT4_INPUTS=int8 reaches the int4 layer: its output is the int8-input product, not the fp32
    one; fp32, the fp32 one."""
    if cpu_extension.kernel_isa() is None:
        pytest.skip("the layers run torch's kernels here (FASTERLLM_CPU_KERNELS=off)")
    torch.manual_seed(3)
    layer = Int4WeightOnlyLinear.from_float(torch.randn(64, 96), None)
    assert layer.native is not None
    x = activations(2, 96, torch.float32)
    isa = cpu_extension.kernel_isa()
    for value, int8 in (("int8", True), ("fp32", False)):
        monkeypatch.setenv(cpu_gemv.INT4_INPUTS_ENV, value)
        cpu_gemv.int4_int8_inputs.cache_clear()
        try:
            expected = cpu_gemv.int4_gemv(x, layer.native, isa, int8_inputs=int8)
            assert torch.equal(layer(x), expected), value
            assert not torch.equal(layer(x), cpu_gemv.int4_gemv(x, layer.native, isa, int8_inputs=not int8)), value
        finally:
            cpu_gemv.int4_int8_inputs.cache_clear()


def test_the_int4_inputs_switch_names_its_choices(monkeypatch):
    for value, int8 in (("int8", True), ("fp32", False), ("", False), ("int4", None)):
        monkeypatch.setenv(cpu_gemv.INT4_INPUTS_ENV, value)
        cpu_gemv.int4_int8_inputs.cache_clear()
        try:
            if int8 is None:
                with pytest.raises(ValueError, match=r"FASTERLLM_CPU_INT4_INPUTS='int4' is not 'fp32'"):
                    cpu_gemv.int4_int8_inputs()
            else:
                assert cpu_gemv.int4_int8_inputs() is int8
        finally:
            cpu_gemv.int4_int8_inputs.cache_clear()
    monkeypatch.delenv(cpu_gemv.INT4_INPUTS_ENV)
    assert cpu_gemv.int4_int8_inputs() is False
    cpu_gemv.int4_int8_inputs.cache_clear()
