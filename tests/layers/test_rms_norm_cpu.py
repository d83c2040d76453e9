"""The CPU RMSNorm (residual add, then the fp32 norm, rounded once before the weight) against transformers'
LlamaRMSNorm on the same weight: bit-equal, as greedy parity needs; through torch's fused op where this torch
has it and through the written-out form."""
import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from fasterllm.layers import norm


@pytest.mark.parametrize("fused", [True, False], ids=["fused-op", "written-out"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_equals_transformers(monkeypatch, fused, dtype):
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
