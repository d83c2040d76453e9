"""The CPU RMSNorm (residual add, then the fp32 norm, rounded once before the weight) against transformers'
LlamaRMSNorm on the same weight: bit-equal, as greedy parity needs, through torch's fused op where this torch
has it and through the written-out form; our C++ op (kernels/native/cpu_rms_norm.py: bf16 and fp32) within one bf16
step of it, or a few fp32 ulps."""
import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from fasterllm.kernels.native import cpu_rms_norm
from fasterllm.layers import norm


@pytest.mark.parametrize("fused", [True, False], ids=["fused-op", "written-out"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_equals_transformers(monkeypatch, fused, dtype):
    monkeypatch.setattr(cpu_rms_norm, "runs", lambda x, weight: False)  # the torch path
    if fused and norm._fused_fp32_rms_norm is None:
        pytest.skip("this torch has no torch._fused_rms_norm")
    if not fused:
        monkeypatch.setattr(norm, "_fused_fp32_rms_norm", None)
    torch.manual_seed(0)
    ours, reference = norm.RMSNorm(576, 1e-5).to(dtype), LlamaRMSNorm(576, eps=1e-5).to(dtype)
    ours.weight.data = reference.weight.data = torch.randn(576).to(dtype)
    for scale in (0.01, 1.0, 100.0):
        hidden, residual = (torch.randn(5, 576) * scale).to(dtype), torch.randn(5, 576).to(dtype)
        normed, new_residual = ours(hidden, residual)
        assert torch.equal(new_residual, hidden + residual)
        assert torch.equal(normed, reference(hidden + residual))


def test_the_cpu_extension_runs_bf16_within_a_bf16_step_of_transformers(cpu_kernels_on):
    torch.manual_seed(0)
    ours, reference = norm.RMSNorm(576, 1e-5).bfloat16(), LlamaRMSNorm(576, eps=1e-5).bfloat16()
    ours.weight.data = reference.weight.data = torch.randn(576).bfloat16()
    assert cpu_rms_norm.runs(torch.ones(1, 576, dtype=torch.bfloat16), ours.weight)
    assert not cpu_rms_norm.runs(torch.ones(1, 576), ours.weight)  # a weight of another dtype: torch's path
    for scale in (0.01, 1.0, 100.0):
        hidden, residual = (torch.randn(37, 576) * scale).bfloat16(), torch.randn(37, 576).bfloat16()
        normed, new_residual = ours(hidden, residual)
        assert torch.equal(new_residual, hidden + residual)
        want = reference(hidden + residual).float()
        assert ((normed.float() - want).abs() <= want.abs() * 2 ** -7).all()
        assert (normed.float() == want).float().mean() > 0.99
        alone, same = ours(hidden)  # no residual: the input is the residual stream
        assert same is hidden
        assert ((alone.float() - reference(hidden).float()).abs() <= reference(hidden).float().abs() * 2 ** -7).all()


def test_fp32_rows_run_through_the_cpu_extension(cpu_kernels_on, monkeypatch):
    """fp32 rows go to our C++ op too, within a few fp32 ulps of transformers (its sum of squares adds in another
    order)."""
    torch.manual_seed(0)
    ours, reference = norm.RMSNorm(576, 1e-5), LlamaRMSNorm(576, eps=1e-5)
    ours.weight.data = reference.weight.data = torch.randn(576)
    calls = []
    native = cpu_rms_norm.add_rms_norm
    monkeypatch.setattr(cpu_rms_norm, "add_rms_norm", lambda *args: calls.append(1) or native(*args))
    hidden, residual = torch.randn(37, 576) * 100.0, torch.randn(37, 576)
    normed, new_residual = ours(hidden, residual)
    assert calls and torch.equal(new_residual, hidden + residual)
    torch.testing.assert_close(normed, reference(hidden + residual), rtol=1e-6, atol=1e-6)
