"""Weight-only INT8 linears against their float reference, and the engine running on them."""
import pytest
import torch
from torch import nn

from fasterllm import LLM, SamplingParams
from fasterllm.layers.quantized_linear import Int8WeightOnlyLinear, quantize_int8_per_channel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_matches_the_float_layer_within_the_rounding_bound(dtype):
    torch.manual_seed(0)
    layer = nn.Linear(256, 96, bias=True).to(dtype)
    x = torch.randn(5, 256).to(dtype)
    quantized = Int8WeightOnlyLinear(layer.weight.detach(), layer.bias.detach())
    got, want = quantized(x).float(), layer(x).float()
    _, scales = quantize_int8_per_channel(layer.weight)
    # each weight is off by at most scale / 2: the product by at most sum|x| * scale / 2, plus dtype rounding
    bound = x.float().abs().sum(dim=1, keepdim=True) * scales[None, :] / 2 + want.abs() * 2 ** -7 + 1e-3
    assert torch.isfinite(got).all()
    assert ((got - want).abs() <= bound).all()
    assert not torch.equal(got, want)  # it really runs on the INT8 weights


def test_quantization_keeps_the_answer_and_shrinks_the_weights():
    llm = LLM(dtype="float32", quantization="int8", max_model_len=256, num_kv_blocks=32)
    model = llm.engine.runner.model
    assert all(isinstance(m, Int8WeightOnlyLinear) for m in (model.layers[0].qkv_proj, model.layers[0].down_proj,
                                                             model.lm_head))
    assert model.layers[0].qkv_proj.qweight.dtype == torch.int8
    reply = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                     SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    assert "Paris" in reply[0].outputs[0].text


def test_unsupported_quantization_is_named():
    with pytest.raises(ValueError, match="quantization='int4'"):
        LLM(quantization="int4")
