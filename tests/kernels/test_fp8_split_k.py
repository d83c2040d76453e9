"""The split-K FP8 GEMM for decode rows against the same e4m3 codes multiplied in fp32 by torch: in Triton's
interpreter on a CPU (small shapes, the split forced by a small SM count), and on a Hopper GPU at the Llama-3-8B
projections it takes (planned for an H100's 132 SMs), against torch._scaled_mm."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from fasterllm.kernels import quant_split_k  # noqa: E402
from fasterllm.kernels.fp8_split_k import MAX_ROWS, fp8_split_k_gemm, split_k_plan  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HOPPER = DEVICE.type == "cuda" and torch.cuda.get_device_capability()[0] >= 9
# Triton's fp8 dot: the interpreter, or a GPU of compute capability 8.9+
fp8_dot = pytest.mark.skipif(DEVICE.type == "cuda" and torch.cuda.get_device_capability() < (8, 9),
                             reason="Triton's fp8 dot needs compute capability 8.9+")
E4M3_MAX = 448.0
# fp32 output: the interpreter sums in fp32 (only the order differs); Hopper's fp8 tensor cores add each tile's
# products into fewer bits before they reach the fp32 sum (torch._scaled_mm: ~1.5e-4 here)
FP32_TOLERANCE = 1e-3 if DEVICE.type == "cuda" else 1e-5


@pytest.fixture
def sms(monkeypatch):
    """Plans made as for a GPU of the given SM count."""
    def use(count: int) -> None:
        monkeypatch.setattr(quant_split_k, "_num_sms", lambda device: count)
    return use


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scales = x.float().abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / E4M3_MAX
    return (x.float() / scales).to(torch.float8_e4m3fn), scales


def operands(m: int, n: int, k: int, with_bias: bool):
    torch.manual_seed(0)
    a, a_scales = quantize_rows(torch.randn(m, k, device=DEVICE))
    b, b_scales = quantize_rows(torch.randn(n, k, device=DEVICE) * 0.05)
    bias = torch.randn(n, device=DEVICE) if with_bias else None
    return a, a_scales, b, b_scales.view(-1), bias


def reference(a, a_scales, b, b_scales, bias):
    out = (a.float() @ b.float().t()) * a_scales * b_scales[None, :]
    return out if bias is None else out + bias


@fp8_dot
@pytest.mark.parametrize("m", [1, 5, MAX_ROWS])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [2048, 1600])  # two K tiles a split; 1600: the last split one partial tile
def test_matches_the_codes_multiplied_in_fp32(sms, m, out_dtype, k):
    n = 128
    sms(4)
    plan = split_k_plan(m, n, k, DEVICE)  # two output tiles on four SMs: K split in four
    assert plan.splits == 4 and plan.k_per_split == 512
    a, a_scales, b, b_scales, bias = operands(m, n, k, with_bias=m != MAX_ROWS)
    got = fp8_split_k_gemm(a, a_scales, b, b_scales, bias, out_dtype, plan)
    expected = reference(a, a_scales, b, b_scales, bias)
    assert got.shape == (m, n) and got.dtype == out_dtype and torch.isfinite(got).all()
    error = ((got.float() - expected).abs().max() / expected.abs().max()).item()
    print(f"relative error {error:.2e}")
    assert error <= (1e-2 if out_dtype == torch.bfloat16 else FP32_TOLERANCE)


def test_the_plan_leaves_wide_projections_and_many_rows_to_cublas(sms):
    sms(132)  # an H100

    def splits(m, n, k):
        plan = split_k_plan(m, n, k, DEVICE)
        assert plan is None or plan.splits * plan.k_per_split >= k
        return None if plan is None else plan.splits

    assert splits(64, 4096, 14336) == 4  # Llama-3-8B down_proj: 64 column tiles
    assert splits(16, 6144, 4096) == 2  # qkv_proj
    assert splits(64, 2 * 14336, 4096) is None  # gate_up_proj fills the GPU unsplit
    assert splits(64, 3584, 18944) == 4  # Qwen2.5-7B down_proj
    assert splits(8, 4096, 4000) == 4  # K the tiles do not divide: the last tile masked
    assert splits(MAX_ROWS + 1, 4096, 4096) is None  # prefill
    assert splits(8, 4000, 4096) is None  # N the tiles do not divide
    assert splits(0, 4096, 4096) is None


def test_bad_operands_are_refused():
    a, a_scales, b, b_scales, _ = operands(4, 128, 512, with_bias=False)
    fits = quant_split_k.SplitKPlan(MAX_ROWS, 64, 256, 256, 2)
    with pytest.raises(ValueError, match="contiguous"):
        fp8_split_k_gemm(a.t().contiguous().t(), a_scales, b, b_scales, None, torch.float32, fits)
    with pytest.raises(ValueError, match="one value per row of a"):
        fp8_split_k_gemm(a, a_scales[:3], b, b_scales, None, torch.float32, fits)
    short = quant_split_k.SplitKPlan(MAX_ROWS, 64, 256, 128, 2)  # two splits of 128 cover half of K
    with pytest.raises(ValueError, match="does not fit"):
        fp8_split_k_gemm(a, a_scales, b, b_scales, None, torch.float32, short)


@pytest.mark.skipif(not HOPPER, reason="torch._scaled_mm's row-wise fp8 needs a Hopper GPU")
@pytest.mark.parametrize("m", [1, 16, 64])
@pytest.mark.parametrize("n, k", [(6144, 4096), (4096, 4096), (4096, 14336)])
def test_llama_8b_projections_match_scaled_mm(sms, m, n, k):
    a, a_scales, b, b_scales, bias = operands(m, n, k, with_bias=True)
    sms(132)  # the plan of an H100, whatever this GPU's SM count
    plan = split_k_plan(m, n, k, DEVICE)
    got = fp8_split_k_gemm(a, a_scales, b, b_scales, bias.bfloat16(), torch.bfloat16, plan)
    expected = torch._scaled_mm(a, b.t(), scale_a=a_scales, scale_b=b_scales.view(1, -1), bias=bias.bfloat16(),
                                out_dtype=torch.bfloat16)
    assert torch.isfinite(got).all()
    assert (got.float() - expected.float()).abs().max() <= 1e-2 * expected.float().abs().max()
