"""Fused activation quantization (layers/quantization/fused_activation.py): the RMSNorm and SiLU*mul before a W8A8
projection write its int8 codes, and the projection gives what it gives when it quantizes float rows itself.
Triton's interpreter on a CPU; the fp8 form and whole quantized engines run in the GPU engine tests."""
from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("triton")
from fasterllm.layers.activation import SiluAndMul  # noqa: E402
from fasterllm.layers.norm import RMSNorm  # noqa: E402
from fasterllm.layers.quantization.fused_activation import (  # noqa: E402
    QuantizedRows, QuantizingRMSNorm, QuantizingSiluAndMul, fuse_activation_quantization)
from fasterllm.layers.quantization.gpu import Int8GPULinear, W8A8GPULinear  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float16  # the interpreter's bf16 dot is wrong
HIDDEN, INTERMEDIATE, TOKENS = 64, 96, 5


def decoder_like_layer(down_proj_kind=W8A8GPULinear.from_float) -> nn.Module:
    """The attributes a decoder layer has, with random weights: norm -> qkv_proj, norm -> gate_up_proj,
    act -> down_proj."""
    torch.manual_seed(0)
    layer = nn.Module()
    for name in ("input_layernorm", "post_attention_layernorm"):
        norm = RMSNorm(HIDDEN, 1e-5).to(DEVICE, DTYPE)
        norm.weight.data = (1 + 0.2 * torch.randn(HIDDEN, device=DEVICE)).to(DTYPE)
        setattr(layer, name, norm)
    layer.qkv_proj = W8A8GPULinear.from_float((torch.randn(80, HIDDEN, device=DEVICE) * 0.05).to(DTYPE), None)
    layer.gate_up_proj = W8A8GPULinear.from_float((torch.randn(2 * INTERMEDIATE, HIDDEN, device=DEVICE) * 0.05).to(DTYPE),
                                                  None)
    layer.act = SiluAndMul()
    layer.down_proj = down_proj_kind((torch.randn(HIDDEN, INTERMEDIATE, device=DEVICE) * 0.05).to(DTYPE), None)
    return layer


def run(layer: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, ...]:
    normed, residual = layer.input_layernorm(x, residual)
    qkv = layer.qkv_proj(normed)
    normed, residual = layer.post_attention_layernorm(qkv[:, :HIDDEN], residual)
    return qkv, layer.down_proj(layer.act(layer.gate_up_proj(normed))), residual


def test_fused_producers_hand_the_projections_the_codes_they_would_make():
    x, residual = (torch.randn(TOKENS, HIDDEN, device=DEVICE).to(DTYPE) for _ in range(2))
    layer = decoder_like_layer()
    unfused = run(layer, x, residual)
    fuse_activation_quantization(layer)
    assert isinstance(layer.input_layernorm, QuantizingRMSNorm) and isinstance(layer.act, QuantizingSiluAndMul)
    assert isinstance(layer.input_layernorm(x, residual)[0], QuantizedRows)
    fused = run(layer, x, residual)
    for got, expected in zip(fused, unfused):
        assert got.dtype == expected.dtype and torch.isfinite(got).all()
        # the same codes up to a tie rounded the other way (one step of one code)
        torch.testing.assert_close(got.float(), expected.float(), atol=0.02 * expected.float().abs().max().item(),
                                   rtol=0)
    torch.testing.assert_close(fused[2], unfused[2], atol=0, rtol=0)  # the residual stream is not quantized


def test_a_producer_stays_float_where_its_projection_takes_float_rows():
    layer = decoder_like_layer(down_proj_kind=Int8GPULinear.from_float)  # w8a8's weight-only down_proj
    fuse_activation_quantization(layer)
    assert isinstance(layer.post_attention_layernorm, QuantizingRMSNorm)
    assert type(layer.act) is SiluAndMul  # down_proj widens int8 weights and reads float rows


def test_a_llama_model_with_fused_w8a8_gives_the_unfused_hidden_states():
    """Through the model's own forward (DecoderLayer reads the token count before its norm returns codes)."""
    from fasterllm.config import ModelConfig
    from fasterllm.layers.attention import AttentionMetadata
    from fasterllm.layers.linear import replace_linears
    from fasterllm.models.llama import LlamaForCausalLM

    cfg = ModelConfig("LlamaForCausalLM", vocab_size=128, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    model = LlamaForCausalLM(cfg, 64, DEVICE, DTYPE)
    torch.manual_seed(0)
    for param in model.parameters():
        param.copy_((torch.randn(param.shape) * 0.1 + (1.0 if param.dim() == 1 else 0.0)).to(DTYPE))
    replace_linears(model, lambda linear: W8A8GPULinear.from_float(linear.weight.detach(), linear.bias))
    ids = torch.randint(0, 128, (7,), device=DEVICE)
    meta = AttentionMetadata.build([7], [7], [[0]], 16, DEVICE)
    unfused = model.hidden_states(ids, meta.positions.to(DEVICE), None, meta)
    fuse_activation_quantization(model)
    assert all(isinstance(layer.input_layernorm, QuantizingRMSNorm) for layer in model.layers)
    assert not isinstance(model.norm, QuantizingRMSNorm)  # the head's input stays float
    fused = model.hidden_states(ids, meta.positions.to(DEVICE), None, meta)
    assert torch.isfinite(fused).all()
    torch.testing.assert_close(fused.float(), unfused.float(), atol=0.03 * unfused.float().abs().max().item(), rtol=0)
