"""The decode-row GEMM (int8 x int8 or e4m3 x e4m3, K split or the epilogue inside) against the same codes multiplied
by torch: in Triton's interpreter on a CPU (small shapes, plans made for a small SM count), and on a Hopper GPU at the
Llama-3-8B projections (planned for an H100's 132 SMs) against torch._scaled_mm (fp8) and the exact integer sums
(int8)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from fasterllm.kernels import decode_gemm as decode_gemm_module  # noqa: E402
from fasterllm.kernels import quant_split_k  # noqa: E402
from fasterllm.kernels.decode_gemm import MAX_ROWS, decode_gemm, decode_gemm_plan  # noqa: E402
from fasterllm.kernels.quant_w8a8 import int8_gemm_reference  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HOPPER = DEVICE.type == "cuda" and torch.cuda.get_device_capability()[0] == 9
# Triton's fp8 dot: the interpreter, or a GPU of compute capability 8.9+
FP8_DOT = DEVICE.type == "cpu" or torch.cuda.get_device_capability() >= (8, 9)
CODES = [torch.int8, pytest.param(torch.float8_e4m3fn, marks=pytest.mark.skipif(
    not FP8_DOT, reason="Triton's fp8 dot needs compute capability 8.9+"))]
CODE_MAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
# fp32 output of e4m3 codes: the interpreter sums in fp32 (only the order differs); Hopper's fp8 tensor cores add each
# tile's products into fewer bits before they reach the fp32 sum (torch._scaled_mm: ~1.5e-4 here). int8 sums are exact.
FP8_FP32_TOLERANCE = 1e-3 if DEVICE.type == "cuda" else 1e-5


@pytest.fixture
def sms(monkeypatch):
    """Plans made as for a Hopper GPU of the given SM count (the kernel itself runs on any GPU with Triton's dot)."""
    def use(count: int) -> None:
        monkeypatch.setattr(quant_split_k, "_num_sms", lambda device: count)
        monkeypatch.setattr(decode_gemm_module, "_runs_decode_gemm", lambda device: True)
    return use


def quantize_rows(x: torch.Tensor, codes: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    scales = x.float().abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / CODE_MAX[codes]
    scaled = x.float() / scales
    return (scaled.round().clamp(-127, 127) if codes == torch.int8 else scaled).to(codes), scales


def operands(m: int, n: int, k: int, codes: torch.dtype, with_bias: bool):
    torch.manual_seed(0)
    a, a_scales = quantize_rows(torch.randn(m, k, device=DEVICE), codes)
    b, b_scales = quantize_rows(torch.randn(n, k, device=DEVICE) * 0.05, codes)
    bias = torch.randn(n, device=DEVICE) if with_bias else None
    return a, a_scales, b, b_scales.view(-1), bias


def check(got, a, a_scales, b, b_scales, bias, out_dtype):
    assert got.shape == (a.shape[0], b.shape[0]) and got.dtype == out_dtype and torch.isfinite(got).all()
    if a.dtype == torch.int8:  # exact integer sums: only the final rounding may differ (one unit in the last place)
        expected = int8_gemm_reference(a, a_scales, b, b_scales, bias, out_dtype).float()
        ulp = torch.finfo(out_dtype).eps * expected.abs().clamp_min(1.0)
        assert ((got.float() - expected).abs() <= ulp).all()
        return
    expected = (a.float() @ b.float().t()) * a_scales * b_scales[None, :] + (0 if bias is None else bias)
    error = ((got.float() - expected).abs().max() / expected.abs().max()).item()
    assert error <= (1e-2 if out_dtype == torch.bfloat16 else FP8_FP32_TOLERANCE)


@pytest.mark.parametrize("codes", CODES)
@pytest.mark.parametrize("m", [1, 5, MAX_ROWS])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [4096, 3900])  # 16 K tiles; 3900: the last one partial
def test_split_k_matches_the_codes_multiplied_in_torch(sms, codes, m, out_dtype, k):
    n = 128
    sms(2)  # two output tiles on two SMs: K split in two (at least eight tiles a split)
    plan = decode_gemm_plan(m, n, k, DEVICE)
    assert plan.splits == 2 and plan.k_per_split == 2048
    sms(4)
    assert decode_gemm_plan(m, n, k, DEVICE) == plan  # four splits would leave four K tiles a split
    a, a_scales, b, b_scales, bias = operands(m, n, k, codes, with_bias=m != MAX_ROWS)
    check(decode_gemm(a, a_scales, b, b_scales, bias, out_dtype, plan), a, a_scales, b, b_scales, bias, out_dtype)


@pytest.mark.parametrize("codes", CODES)
@pytest.mark.parametrize("m", [3, MAX_ROWS])
@pytest.mark.parametrize("k", [4096, 3900])  # 16 K tiles, enough for two splits; 3900: the last one partial
def test_one_split_applies_the_epilogue_itself(sms, codes, m, k):
    n = 192
    sms(1)  # three output tiles already fill one SM's two programs: no split
    plan = decode_gemm_plan(m, n, k, DEVICE)
    assert plan.splits == 1
    a, a_scales, b, b_scales, bias = operands(m, n, k, codes, with_bias=True)
    check(decode_gemm(a, a_scales, b, b_scales, bias, torch.bfloat16, plan), a, a_scales, b, b_scales, bias,
          torch.bfloat16)


def test_plans_at_the_8b_shapes(sms):
    sms(132)  # an H100

    def splits(m, n, k):
        plan = decode_gemm_plan(m, n, k, DEVICE)
        assert plan is None or plan.splits * plan.k_per_split >= k
        return None if plan is None else plan.splits

    assert splits(64, 4096, 14336) == 4  # Llama-3-8B down_proj: 64 column tiles
    assert splits(16, 6144, 4096) == 2  # qkv_proj
    assert splits(64, 4096, 4096) == 2  # o_proj: 16 K tiles, eight a split
    assert splits(64, 2 * 14336, 4096) == 1  # gate_up_proj fills the GPU unsplit
    assert splits(64, 3584, 18944) == 4  # Qwen2.5-7B down_proj
    assert splits(8, 4096, 4000) == 2  # 16 K tiles, the last one partial: masked
    assert splits(MAX_ROWS + 1, 4096, 4096) is None  # prefill
    assert splits(8, 4000, 4096) is None  # N the tiles do not divide
    assert splits(0, 4096, 4096) is None


@pytest.mark.parametrize("capability, hip", [((8, 0), None), ((12, 0), None), ((9, 4), "6.2")])
def test_gpus_other_than_nvidia_hopper_keep_cublas(monkeypatch, capability, hip):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.version, "hip", hip)
    quant_split_k.nvidia_capability.cache_clear()
    try:
        assert decode_gemm_plan(16, 4096, 4096, torch.device("cuda", 0)) is None
    finally:
        quant_split_k.nvidia_capability.cache_clear()  # the real GPU's answer next time


def test_bad_operands_are_refused():
    a, a_scales, b, b_scales, _ = operands(4, 128, 512, torch.int8, with_bias=False)
    fits = quant_split_k.SplitKPlan(MAX_ROWS, 64, 256, 256, 2)
    with pytest.raises(ValueError, match="int8 by int8"):
        decode_gemm(a, a_scales, b.float(), b_scales, None, torch.float32, fits)
    with pytest.raises(ValueError, match="contiguous"):
        decode_gemm(a.t().contiguous().t(), a_scales, b, b_scales, None, torch.float32, fits)
    with pytest.raises(ValueError, match="one value per row of a"):
        decode_gemm(a, a_scales[:3], b, b_scales, None, torch.float32, fits)
    short = quant_split_k.SplitKPlan(MAX_ROWS, 64, 256, 128, 2)  # two splits of 128 cover half of K
    with pytest.raises(ValueError, match="does not fit"):
        decode_gemm(a, a_scales, b, b_scales, None, torch.float32, short)
    ragged = quant_split_k.SplitKPlan(MAX_ROWS, 64, 256, 384, 2)  # the second split would start mid-tile
    with pytest.raises(ValueError, match="does not fit"):
        decode_gemm(a, a_scales, b, b_scales, None, torch.float32, ragged)


@pytest.mark.skipif(not HOPPER, reason="the decode GEMM runs on Hopper GPUs")
@pytest.mark.parametrize("codes", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("m", [1, 16, 64])
@pytest.mark.parametrize("n, k", [(6144, 4096), (4096, 4096), (2 * 14336, 4096), (4096, 14336)])
def test_llama_8b_projections_match_cublas(sms, codes, m, n, k):
    a, a_scales, b, b_scales, bias = operands(m, n, k, codes, with_bias=True)
    sms(132)  # the plan of an H100, whatever this GPU's SM count
    plan = decode_gemm_plan(m, n, k, DEVICE)
    got = decode_gemm(a, a_scales, b, b_scales, bias.bfloat16(), torch.bfloat16, plan)
    if codes == torch.int8:  # exact sums: within a unit in the last place of the integer reference
        check(got, a, a_scales, b, b_scales, bias.bfloat16(), torch.bfloat16)
        return
    expected = torch._scaled_mm(a, b.t(), scale_a=a_scales, scale_b=b_scales.view(1, -1), bias=bias.bfloat16(),
                                out_dtype=torch.bfloat16)
    assert torch.isfinite(got).all()
    assert (got.float() - expected.float()).abs().max() <= 1e-2 * expected.float().abs().max()
