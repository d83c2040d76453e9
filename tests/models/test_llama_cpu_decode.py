"""A CPU decode step (one sequence's or a batch's) through every layer in one C++ call (models/llama_cpu_decode.py):
the layers' own operators chained in C++, so SmolLM2 quantized with each method (bf16 and fp32) and unquantized
(bf16, its weights packed for oneDNN or plain), and tiny Qwen2 / Qwen3 / Llama 3 checkpoints, must choose the same
tokens with the same logprobs as the Python layers, to the bit, alone or in a batch that shrinks as sequences finish;
and a model with a layer the C++ stack does not run keeps the Python layers."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from fasterllm import LLM, SamplingParams
from fasterllm.sampling_params import BeamSearchParams
from fasterllm.kernels.native import cpu_gemv
from fasterllm.layers.attention import AttentionMetadata
from fasterllm.layers.linear import PackedCPULinear, TiledCPULinear, can_pack
from fasterllm.models.cpu_decode_linears import INT4_INT8_INPUTS
from fasterllm.models.llama_cpu_decode import CPUDecodeStack
from fasterllm.models.registry import supported_models
from fasterllm.worker import decoder_builder
from decode_stacks import CountingStack

sys.path.insert(0, str(Path(__file__).parents[1] / "parity"))
from parity_utils import TINY_SPECS, build_tiny_model, random_prompt  # noqa: E402

PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "def fibonacci(n):"]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def int8_bf16(gguf, module_cpu_kernels_on):
    return _load(gguf, "int8", "bfloat16")


@pytest.fixture(scope="module")
def int8_fp32(gguf, module_cpu_kernels_on):
    return _load(gguf, "int8", "float32")


def _load(gguf, method: str, dtype: str) -> LLM:
    # no prefix caching: the run without the stack must compute every prompt again
    return LLM(str(gguf), quantization=method, dtype=dtype, max_model_len=256, num_kv_blocks=64,
               enable_prefix_caching=False)


def _greedy(llm: LLM, prompts: list[str], max_tokens: list[int]):
    """Per prompt: the tokens and, per step, {token: logprob} of the 5 likeliest."""
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=5) for n in max_tokens]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [{t: entry[t].logprob for t in entry} for entry in o.outputs[0].logprobs])
            for o in outs]


def _with_and_without_stack(llm: LLM, monkeypatch, run):
    """run() with the model's C++ stack (counting its steps), then with the Python layers."""
    model = llm.engine.executor.runner.model
    assert model.cpu_decode_stack is not None
    counting = CountingStack(model.cpu_decode_stack)
    monkeypatch.setattr(model, "cpu_decode_stack", counting)
    ours = run()
    monkeypatch.setattr(model, "cpu_decode_stack", None)
    return ours, run(), counting.calls


@pytest.mark.parametrize("method, dtype, packed", [("int8", "bfloat16", True), ("int8", "float32", True),
                                                   ("gguf", "float32", True), ("int4", "bfloat16", True),
                                                   (None, "bfloat16", True), (None, "bfloat16", False),
                                                   (None, "float32", True)])
def test_single_stream_decode_gives_the_layers_tokens_and_logprobs(request, gguf, module_cpu_kernels_on, monkeypatch,
                                                                   method, dtype, packed):
    """packed: bf16 weights in oneDNN's layout where this CPU has oneDNN bf16 kernels (else plain, as a CPU without
    them keeps them), fp32 ones in our tiles; False: plain weights here too. An unquantized fp32 model takes the stack
    too: its products are not transformers' to the bit, so its norms and attention need not be."""
    loaded = {("int8", "bfloat16"): "int8_bf16", ("int8", "float32"): "int8_fp32"}
    key = (method, dtype)
    if not packed:
        monkeypatch.setattr(decoder_builder, "can_pack", lambda device, dtype: False)
    llm = request.getfixturevalue(loaded[key]) if key in loaded else _load(gguf, method, dtype)
    if method is None and dtype == "float32":
        assert type(llm.engine.executor.runner.model.layers[0].qkv_proj) is TiledCPULinear
    elif method is None:
        wanted = torch.nn.Linear if not packed or not can_pack(torch.device("cpu"), torch.bfloat16) else PackedCPULinear
        assert type(llm.engine.executor.runner.model.layers[0].qkv_proj) is wanted
    ours, layers, calls = _with_and_without_stack(
        llm, monkeypatch, lambda: [_greedy(llm, [prompt], [NEW_TOKENS])[0] for prompt in PROMPTS])
    assert calls == len(PROMPTS) * (NEW_TOKENS - 1)  # every decode step (the first token comes from the prefill)
    assert ours == layers


def test_int4_with_int8_inputs_gives_the_layers_tokens_and_logprobs(gguf, module_cpu_kernels_on, monkeypatch):
    """FASTERLLM_CPU_INT4_INPUTS=int8: the 4-bit products quantize their inputs first, in the stack as in the layers."""
    monkeypatch.setenv(cpu_gemv.INT4_INPUTS_ENV, "int8")
    cpu_gemv.int4_int8_inputs.cache_clear()
    try:
        llm = _load(gguf, "int4", "bfloat16")
        assert INT4_INT8_INPUTS in llm.engine.executor.runner.model.cpu_decode_stack.kinds[0::2]
        ours, layers, calls = _with_and_without_stack(
            llm, monkeypatch, lambda: [_greedy(llm, [prompt], [NEW_TOKENS])[0] for prompt in PROMPTS[:2]])
    finally:
        monkeypatch.delenv(cpu_gemv.INT4_INPUTS_ENV)
        cpu_gemv.int4_int8_inputs.cache_clear()
    assert calls == 2 * (NEW_TOKENS - 1)
    assert ours == layers


def test_a_batch_decodes_through_it_as_it_shrinks(int8_bf16, monkeypatch):
    """Three sequences of 4, 8 and 16 tokens: every decode step (three rows, then two, then one) runs the stack, and
    every token and logprob is the Python layers'."""
    ours, layers, calls = _with_and_without_stack(int8_bf16, monkeypatch,
                                                  lambda: _greedy(int8_bf16, PROMPTS, [4, 8, 16]))
    assert calls == 15  # the prompts' step gives each its first token
    assert ours == layers


def test_beam_search_and_seeded_sampling_give_the_layers_results(int8_bf16, monkeypatch):
    """Beams (forked blocks, copy-on-write) and n = 3 seeded samples decode through the stack as a batch: the same
    hypotheses, scores and samples as the Python layers."""
    def run():
        beams = int8_bf16.beam_search([{"prompt": PROMPTS[0]}], BeamSearchParams(beam_width=4, max_tokens=NEW_TOKENS))
        sampled = int8_bf16.generate([PROMPTS[1]], SamplingParams(n=3, temperature=0.8, seed=7, max_tokens=NEW_TOKENS),
                                     use_tqdm=False)
        return ([(s.token_ids, s.cumulative_logprob) for s in beams[0].sequences],
                [c.token_ids for c in sampled[0].outputs])

    ours, layers, calls = _with_and_without_stack(int8_bf16, monkeypatch, run)
    assert calls > 0
    assert ours == layers


def test_scattered_blocks_give_the_layers_hidden_states_and_cache(int8_bf16):
    """A decode step over blocks 5, 2, 7 (ids passed to the C++ attention, not a range) of a cache full of random
    keys and values: the same final hidden row and the same cache afterwards, the new token's K/V stored in it."""
    model = int8_bf16.engine.executor.runner.model
    layer = model.layers[0].attn
    generator = torch.Generator().manual_seed(0)
    caches = torch.randn(len(model.layers), 2, 8, 16, layer.num_kv_heads, layer.head_dim, generator=generator).to(
        torch.bfloat16)
    before = caches.clone()
    meta = AttentionMetadata.build([1], [40], [[5, 2, 7]], 16, torch.device("cpu"))
    assert isinstance(meta.decode.blocks, torch.Tensor)
    token = torch.tensor([1234])
    stack = model.cpu_decode_stack
    assert stack.takes(model.embed_tokens.partial_rows(token), caches, meta)
    ours = model.hidden_states(token, meta.positions, caches, meta)
    layers_caches = before.clone()
    model.cpu_decode_stack = None
    try:
        want = model.hidden_states(token, meta.positions, layers_caches, meta)
    finally:
        model.cpu_decode_stack = stack
    assert torch.equal(ours, want)
    assert torch.equal(caches, layers_caches)
    slot = 7 * 16 + 39 % 16  # position 39 in the third block, block 7
    assert not torch.equal(caches.view(len(model.layers), 2, -1, layer.num_kv_heads, layer.head_dim)[:, :, slot],
                           before.view(len(model.layers), 2, -1, layer.num_kv_heads, layer.head_dim)[:, :, slot])


@pytest.mark.parametrize("name, window", [("qwen2_bias_tied", None), ("qwen3_qk_norm", None), ("llama3_gqa", None),
                                          ("mistral_mqa", 6), ("phi3_fused", 6)])
def test_families_with_biases_head_norms_and_a_window_decode_through_it_to_the_bit(module_cpu_kernels_on, tmp_path,
                                                                                   monkeypatch, name, window):
    """Qwen2's q/k/v biases, Qwen3's per-head q/k norms and Mistral's and Phi-3's sliding window (6 keys, shorter
    than the prompt) run inside the C++ stack too (tiny random checkpoints with 64-wide heads, which the C++ attention
    runs), with the Python layers' tokens and logprobs."""
    pytest.importorskip("transformers")
    # Phi-3's heads are hidden / heads wide: one head of 64
    heads = {"num_attention_heads": 1, "num_key_value_heads": 1} if name.startswith("phi3") else {}
    build_tiny_model(next(spec for spec in TINY_SPECS if spec.name == name), tmp_path, seed=3, sliding_window=window,
                     head_dim=64, **heads)
    llm = LLM(str(tmp_path), quantization="int8", dtype="bfloat16", max_model_len=128, num_kv_blocks=32,
              enable_prefix_caching=False)
    layer = llm.engine.executor.runner.model.layers[0]
    assert layer.attn.sliding_window == window and layer.attn.head_dim == 64
    prompt = random_prompt(9, 256, seed=4)

    def greedy():
        params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5)
        out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
        return out.token_ids, [{t: entry[t].logprob for t in entry} for entry in out.logprobs]

    ours, layers, calls = _with_and_without_stack(llm, monkeypatch, greedy)
    assert calls == NEW_TOKENS - 1
    assert ours == layers


@pytest.mark.parametrize("name", ["llama3_gqa", "mistral_mqa", "qwen2_bias_tied", "qwen3_qk_norm", "phi3_fused",
                                  "gemma2_softcap_window", "mixtral_moe"])
def test_fasterllm_models_says_which_architectures_take_it(module_cpu_kernels_on, tmp_path, name):
    """`fasterllm models`' cpu_decode_step column against what a quantized tiny checkpoint of the family gets."""
    pytest.importorskip("transformers")
    heads = {"num_attention_heads": 1, "num_key_value_heads": 1} if name.startswith("phi3") else {}
    build_tiny_model(next(spec for spec in TINY_SPECS if spec.name == name), tmp_path, seed=3, head_dim=64, **heads)
    llm = LLM(str(tmp_path), quantization="int8", dtype="bfloat16", max_model_len=128, num_kv_blocks=32)
    architecture = llm.engine.model_config.architecture
    row = next(row for row in supported_models() if row["architecture"] == architecture)
    taken = llm.engine.executor.runner.model.cpu_decode_stack is not None
    assert row["cpu_decode_step"] == ("one C++ call" if taken else "Python layers")


@pytest.mark.parametrize("change", ["a window in one layer", "clipped q/k/v", "another projection"])
def test_a_layer_it_does_not_run_keeps_the_python_layers(int8_bf16, monkeypatch, change):
    model = int8_bf16.engine.executor.runner.model
    assert CPUDecodeStack.of(model) is not None
    layer = model.layers[5]
    if change == "a window in one layer":  # Gemma's alternation: the layers' windows differ
        monkeypatch.setattr(layer.attn, "sliding_window", 64)
    elif change == "clipped q/k/v":  # OLMoE's
        monkeypatch.setattr(layer, "clip_qkv", 8.0)
    else:
        monkeypatch.setattr(layer, "gate_up_proj", torch.nn.Identity())
    assert CPUDecodeStack.of(model) is None
