"""A mixture of experts under quantization='int8': its experts become int8 codes with a scale per output channel
(layers/moe.py), and the model answers as the same model over those codes' float values (fp32, CPU)."""
from __future__ import annotations

import pytest
import torch

from parity_utils import MAX_POS, full_logits, max_abs_diff, random_prompt

from fasterllm import LLM
from fasterllm.layers.moe import SparseMoE

pytest.importorskip("transformers")


@pytest.mark.parametrize("name", ["mixtral_moe", "qwen2_moe_shared", "deepseek_v2_lite_yarn"])
def test_int8_experts_are_codes_and_answer_as_their_float_values(name, tiny_checkpoints):
    directory, _ = tiny_checkpoints[name]
    float_llm, llm = (LLM(str(directory), dtype="float32", device="cpu", max_model_len=MAX_POS, num_kv_blocks=32,
                          quantization=method) for method in (None, "int8"))
    model = llm.engine.executor.runner.model
    moes = [module for module in model.modules() if isinstance(module, SparseMoE)]
    assert moes
    for moe in moes:
        experts, rows, _ = moe.w_gate_up.shape
        assert moe.w_gate_up.dtype == moe.w_down.dtype == torch.int8  # half the bytes of bf16, a quarter of fp32
        assert moe.scales[0].shape == (experts, rows) and moe.scales[1].shape == moe.w_down.shape[:2]
        assert moe.router.dtype == torch.float32  # routing decides everything: kept float
    ids = random_prompt(60, model.config.vocab_size, 5)
    quantized = full_logits(model, ids)
    unquantized = full_logits(float_llm.engine.executor.runner.model, ids)
    # int8 rounding of every weight (attention's too) moves the logits by a few percent of their spread on average (a
    # token whose router then picks another expert moves more), as it moves a dense tiny model's (measured: 1.7-3.2%)
    assert (quantized - unquantized).abs().mean() < 0.06 * unquantized.std()
    assert (quantized.argmax(-1) == unquantized.argmax(-1)).float().mean() > 0.8
    # each MoE layer, on the input it had, answers as the same layer over its codes * scales as float weights. Layer
    # by layer, not through the model: the int8 layers around the experts round their inputs, so the last bits of a
    # difference upstream can flip one rounding and move a logit by 1e-3 (seen at one of 60 positions)
    seen = {}

    def keep(module, args, out) -> None:  # None: the layer's output stays as it is
        seen.setdefault(module, (args[0], out))

    hooks = [moe.register_forward_hook(keep) for moe in moes]
    full_logits(model, ids)
    for hook in hooks:
        hook.remove()
    for moe in moes:
        hidden, out = seen[moe]
        moe.w_gate_up = torch.nn.Parameter(moe.w_gate_up.float() * moe.scales[0][..., None], requires_grad=False)
        moe.w_down = torch.nn.Parameter(moe.w_down.float() * moe.scales[1][..., None], requires_grad=False)
        moe.scales = None
        assert max_abs_diff(moe(hidden), out) < 1e-5
