"""KV-cache scales from the checkpoint (compressed-tensors' kv_cache_scheme, as llm-compressor writes it): each layer's
k_scale and v_scale reach its attention layer, the engine's logprobs over the fp8 cache match transformers with K and
V rounded through e4m3 at those scales (and not at 1.0), and scales it cannot run are errors naming them."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "parity"))
from parity_utils import TINY_SPECS, build_tiny_model, random_prompt  # noqa: E402

from fasterllm import LLM, SamplingParams  # noqa: E402

pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import AttentionInterface  # noqa: E402
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402

SPEC = next(s for s in TINY_SPECS if s.name == "llama3_gqa")
PROMPTS = [random_prompt(n, SPEC.vocab_size, 900 + n) for n in (7, 40)]
FP8_MAX = 448.0


def through_e4m3(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x as an fp8 cache gives it back: x / scale on the e4m3 grid (saturated at +-448), times scale."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float().to(x.dtype) * scale


def attention_over_an_fp8_cache(module, query, key, value, attention_mask, **kwargs):
    """transformers' attention with the rotated K and V rounded as the cache holds them (module.kv_scales), or, while
    module.kv_maxima is a list, their largest magnitudes recorded instead (calibration)."""
    if isinstance(getattr(module, "kv_maxima", None), list):
        module.kv_maxima.append((key.abs().max().item(), value.abs().max().item()))
    else:
        key, value = through_e4m3(key, module.kv_scales[0]), through_e4m3(value, module.kv_scales[1])
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register("fp8_kv_cache_reference", attention_over_an_fp8_cache)


def calibrated_scales(model) -> list[tuple[float, float]]:
    """Each layer's (k_scale, v_scale) as llm-compressor's static per-tensor calibration gives them: the largest
    magnitude over the prompts / 448, with the layers made to differ (x 1, 2, ...) so a swapped layer shows."""
    model.config._attn_implementation = "fp8_kv_cache_reference"
    attentions = [layer.self_attn for layer in model.model.layers]
    for attention in attentions:
        attention.kv_maxima = []
    with torch.no_grad():
        for prompt in PROMPTS:
            model(torch.tensor([prompt]))
    scales = []
    for index, attention in enumerate(attentions):
        k_max, v_max = (max(values) for values in zip(*attention.kv_maxima))
        del attention.kv_maxima
        scales.append((float(torch.tensor(k_max / FP8_MAX * (index + 1))),
                       float(torch.tensor(v_max / FP8_MAX * (index + 1)))))
    return scales


def reference_logprobs(model, scales: list[tuple[float, float]]) -> list[torch.Tensor]:
    """transformers' fp32 prompt logprobs of PROMPTS with each layer's K and V through e4m3 at its scales."""
    model.config._attn_implementation = "fp8_kv_cache_reference"
    for layer, layer_scales in zip(model.model.layers, scales):
        layer.self_attn.kv_scales = layer_scales
    out = []
    with torch.no_grad():
        for prompt in PROMPTS:
            logprobs = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
            out.append(logprobs[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])])
    return out


def engine_logprobs(llm: LLM) -> list[torch.Tensor]:
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [torch.tensor([next(iter(entry.values())).logprob for entry in output.prompt_logprobs[1:]])
            for output in outputs]


def add_kv_cache_scales(directory: Path, scales: list[tuple[float | torch.Tensor, float | torch.Tensor]],
                        names: tuple[str, str] = ("k_scale", "v_scale"), **scheme_changes) -> None:
    """Write scales into the checkpoint's safetensors file as model.layers.N.self_attn.<names> (float32 [1]; a
    tensor as given) and a kv_cache_scheme (fp8 per tensor, static) into its config.json's quantization_config (a
    quantized checkpoint's, or one of its own), as llm-compressor does."""
    path = directory / "model.safetensors"
    tensors = load_file(path)
    for index, pair in enumerate(scales):
        for name, scale in zip(names, pair):
            tensors[f"model.layers.{index}.self_attn.{name}"] = \
                scale if isinstance(scale, torch.Tensor) else torch.tensor([scale], dtype=torch.float32)
    save_file(tensors, path, metadata={"format": "pt"})
    scheme = QuantizationArgs(num_bits=8, type="float", strategy="tensor", dynamic=False, symmetric=True)
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    quantization = config.get("quantization_config") or {
        **QuantizationConfig(config_groups={}).model_dump(), "quant_method": "compressed-tensors"}
    quantization["kv_cache_scheme"] = {**scheme.model_dump(), **scheme_changes}
    config_path.write_text(json.dumps({**config, "quantization_config": quantization}))


def test_the_checkpoints_scales_reach_the_layers_and_round_k_and_v_as_the_reference_does(tmp_path):
    model = build_tiny_model(SPEC, tmp_path)
    scales = calibrated_scales(model)
    add_kv_cache_scales(tmp_path, scales)
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", num_kv_blocks=64, block_size=8)
    runner = llm.engine.executor.runner
    assert runner.kv_caches.dtype == torch.float8_e4m3fn  # "auto" follows the checkpoint's kv_cache_scheme
    assert [layer.attn.kv_scales for layer in runner.model.layers] == scales
    ours = engine_logprobs(llm)
    # the same e4m3 values: only fp32 noise in K and V before rounding (a value flipped to the next e4m3 step here and
    # there) and in the attention's arithmetic separates the two
    for engine, reference in zip(ours, reference_logprobs(model, scales)):
        torch.testing.assert_close(engine, reference, atol=2e-4, rtol=0)
    # at scale 1.0 the same K and V fall on another e4m3 grid (their small values on its coarse subnormal steps):
    # logprobs 0.1 to 0.4 nats away
    unscaled = reference_logprobs(model, [(1.0, 1.0)] * len(scales))
    assert min((engine - reference).abs().max() for engine, reference in zip(ours, unscaled)) > 0.02
    explicit = LLM(str(tmp_path), dtype="float32", device="cpu", num_kv_blocks=64, block_size=8,
                   kv_cache_dtype="fp8")
    assert all(torch.equal(a, b) for a, b in zip(engine_logprobs(explicit), ours))


def test_the_older_output_scale_names_carry_the_same_scales(tmp_path):
    build_tiny_model(SPEC, tmp_path)
    scales = [(0.01, 0.02), (0.03, 0.04)]
    add_kv_cache_scales(tmp_path, scales, names=("k_proj.output_scale", "v_proj.output_scale"))
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", num_kv_blocks=16, kv_cache_dtype="fp8")
    expected = [tuple(float(torch.tensor(s)) for s in pair) for pair in scales]
    assert [layer.attn.kv_scales for layer in llm.engine.executor.runner.model.layers] == expected


def test_scales_it_cannot_run_are_errors_naming_the_tensor_the_value_and_the_fix(tmp_path):
    build_tiny_model(SPEC, tmp_path)
    original = (tmp_path / "model.safetensors").read_bytes(), (tmp_path / "config.json").read_text()

    def refused(scales, message, **scheme_changes):
        (tmp_path / "model.safetensors").write_bytes(original[0])
        (tmp_path / "config.json").write_text(original[1])
        add_kv_cache_scales(tmp_path, scales, **scheme_changes)
        with pytest.raises(ValueError, match=message):
            LLM(str(tmp_path), device="cpu", num_kv_blocks=16, kv_cache_dtype="fp8")

    per_head = torch.tensor([0.01, 0.02])  # one per KV head
    refused([(per_head, 0.01), (0.01, 0.01)], r"'model.layers.0.self_attn.k_scale' has shape \(2,\); fasterllm's fp8 "
            r"KV cache takes one K and one V scale per layer .*strategy 'attn_head', one per KV head, is not "
            r"supported\): re-export the checkpoint with llm-compressor's kv_cache_scheme strategy 'tensor'")
    refused([(0.01, 0.01), (0.01, 0.0)], r"'model.layers.1.self_attn.v_scale' = 0.0, but a KV-cache scale must be a "
            r"positive finite number .*calibrate the checkpoint again")
    refused([(-0.5, 0.01), (0.01, 0.01)], r"'model.layers.0.self_attn.k_scale' = -0.5")
    refused([(0.01, 0.01)], r"declares a kv_cache_scheme but lacks 2 of its 4 scales \(k_scale of layer 1, v_scale of "
            r"layer 1\); the checkpoint is incomplete: export it again, or remove kv_cache_scheme")
    refused([(0.01, 0.01)] * 2, r"kv_cache_scheme has strategy 'attn_head'; fasterllm's fp8 KV cache takes one",
            strategy="attn_head")
    refused([(0.01, 0.01)] * 2, r"kv_cache_scheme .*'num_bits': 4.* is not supported; supported: a kv_cache_scheme of "
            r"8-bit floats", num_bits=4)
    (tmp_path / "config.json").write_text(original[1])  # scales the config does not declare: not weights either
    with pytest.raises(ValueError, match=r"checkpoint tensor 'model.layers.0.self_attn.k_scale' does not belong"):
        LLM(str(tmp_path), device="cpu", num_kv_blocks=16, kv_cache_dtype="fp8")


def test_swap_prefix_caching_and_chunks_read_the_scaled_cache_back_unchanged(tmp_path):
    """The same tokens from a roomy engine and from one that chunks prompts, preempts by swapping blocks out (as bytes)
    and back, and finds the second round's prompts in the prefix cache: every path reads the layer's scaled e4m3
    values as they were stored."""
    model = build_tiny_model(SPEC, tmp_path)
    add_kv_cache_scales(tmp_path, calibrated_scales(model))
    prompts = [{"prompt_token_ids": random_prompt(n, SPEC.vocab_size, 700 + n)} for n in (30, 41, 35)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def two_rounds(**engine_args):
        llm = LLM(str(tmp_path), dtype="float32", device="cpu", max_model_len=64, block_size=8, **engine_args)
        rounds = [[o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] for _ in range(2)]
        return rounds, llm.engine.stats()

    reference, _ = two_rounds(num_kv_blocks=64, enable_prefix_caching=False)
    squeezed, stats = two_rounds(num_kv_blocks=14, preemption_mode="swap", swap_space_gib=0.01,
                                 max_num_batched_tokens=12)
    assert squeezed == reference
    assert stats.num_swapped_out > 0 and stats.prefix_cache_hits > 0


def test_a_quantized_checkpoint_runs_its_codes_and_its_kv_cache_scales(tmp_path):
    from test_compressed_tensors import SCHEMES, write_compressed

    model = build_tiny_model(SPEC, tmp_path)
    scheme, quantization_format, layer, _ = SCHEMES["W8A16"]
    write_compressed(tmp_path, model, scheme, quantization_format)  # model: the library's dequantized weights
    scales = calibrated_scales(model)
    add_kv_cache_scales(tmp_path, scales)
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", num_kv_blocks=64, block_size=8)
    runner = llm.engine.executor.runner
    assert type(runner.model.layers[0].qkv_proj).__name__ == layer
    assert [layer.attn.kv_scales for layer in runner.model.layers] == scales
    # the int8 layer multiplies bf16 activations (test_compressed_tensors.py's tolerance for it against fp32)
    for engine, reference in zip(engine_logprobs(llm), reference_logprobs(model, scales)):
        torch.testing.assert_close(engine, reference, atol=0.08, rtol=0.02)


def test_every_tensor_parallel_rank_runs_the_whole_layers_scales(tmp_path):
    model = build_tiny_model(SPEC, tmp_path)
    scales = calibrated_scales(model)
    add_kv_cache_scales(tmp_path, scales)
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", num_kv_blocks=64, block_size=8, tensor_parallel_size=2)
    try:
        ours = engine_logprobs(llm)
    finally:
        llm.engine.shutdown()
    # each rank's KV head (of 2) through its layer's one scale: the one-device tolerance (the all-reduce only adds
    # fp32 noise)
    for engine, reference in zip(ours, reference_logprobs(model, scales)):
        torch.testing.assert_close(engine, reference, atol=2e-4, rtol=0)
