"""On a GPU: the fp8 KV cache through the kernels, CUDA graphs and piecewise graphs. Prompt logprobs (chunked, so
later chunks read earlier ones back) against the CPU torch path over the same e4m3 cache and against the model's
own dtype; greedy tokens of a staggered batch replayed from graphs equal the eager engine's; a checkpoint's KV-cache
scales (compressed-tensors' kv_cache_scheme) through the same kernels and graphs. Skipped without CUDA."""
from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest
import torch

from fasterllm import LLM, SamplingParams
from parity_utils import build_tiny_model, random_prompt, run_staggered
from test_generation import GREEDY, TINY_ARRIVALS, TINY_PROMPT_LENGTHS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytest.importorskip("transformers")


def prompt_logprobs(directory, device: str, kv_cache_dtype: str, prompt: list[int]) -> torch.Tensor:
    llm = LLM(str(directory), dtype="float32", device=device, max_model_len=256, block_size=16,
              max_num_batched_tokens=24, kv_cache_dtype=kv_cache_dtype, gpu_memory_utilization=0.2,
              enable_prefix_caching=False)
    out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    values = torch.tensor([entry[token].logprob for token, entry in zip(prompt[1:], out.prompt_logprobs[1:])])
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return values


def test_prompt_logprobs_match_the_cpu_path_over_the_same_fp8_cache(tiny_checkpoints):
    directory, _ = tiny_checkpoints["llama3_gqa"]
    prompt = random_prompt(100, 384, 7)
    gpu_fp8 = prompt_logprobs(directory, "cuda", "fp8", prompt)
    cpu_fp8 = prompt_logprobs(directory, "cpu", "fp8", prompt)
    gpu_float = prompt_logprobs(directory, "cuda", "auto", prompt)
    # the same e4m3 values read by other arithmetic: fp32 noise may flip a value's rounding here and there
    assert (gpu_fp8 - cpu_fp8).abs().mean() < 2e-3 and (gpu_fp8 - cpu_fp8).abs().max() < 0.05
    # the cache was e4m3: this random model's small K/V values sit in e4m3's coarse subnormal range, so the cost is
    # larger than a real model's (SmolLM2's perplexity moves by about 1%: tests/parity/test_perplexity.py)
    quantization = (gpu_fp8 - gpu_float).abs()
    assert 1e-4 < quantization.mean() < 0.25


def test_graph_replays_give_the_eager_tokens_with_an_fp8_cache(tiny_checkpoints):
    directory, _ = tiny_checkpoints["llama3_gqa"]
    prompts = [random_prompt(n, 384, 300 + n) for n in TINY_PROMPT_LENGTHS]
    outputs = {}
    for eager in (True, False):
        llm = LLM(str(directory), dtype="float32", device="cuda", max_model_len=128, block_size=8,
                  max_num_batched_tokens=16, max_num_seqs=3, kv_cache_dtype="fp8", gpu_memory_utilization=0.2,
                  enforce_eager=eager)
        runner = llm.engine.executor.runner
        assert runner.kv_caches.dtype == torch.float8_e4m3fn and (runner.graphs is None) == eager
        outputs[eager] = run_staggered(llm.engine, prompts, TINY_ARRIVALS, GREEDY)
        del llm, runner
        gc.collect()
        torch.cuda.empty_cache()
    assert outputs[False] == outputs[True]


def test_a_checkpoints_kv_cache_scales_run_through_the_kernels_and_graphs(tmp_path):
    pytest.importorskip("compressed_tensors")
    sys.path.insert(0, str(Path(__file__).parents[1] / "loader"))
    from test_kv_cache_scales import (SPEC, add_kv_cache_scales, calibrated_scales, engine_logprobs,
                                      reference_logprobs)

    model = build_tiny_model(SPEC, tmp_path)
    scales = calibrated_scales(model)
    add_kv_cache_scales(tmp_path, scales)
    prompts = [random_prompt(n, SPEC.vocab_size, 300 + n) for n in TINY_PROMPT_LENGTHS]
    outputs = {}
    for eager in (True, False):
        # prompts in chunks of 16: later chunks read earlier ones back through the attention kernel
        llm = LLM(str(tmp_path), dtype="float32", device="cuda", max_model_len=128, block_size=8,
                  max_num_batched_tokens=16, max_num_seqs=3, gpu_memory_utilization=0.2, enforce_eager=eager)
        runner = llm.engine.executor.runner
        assert runner.kv_caches.dtype == torch.float8_e4m3fn and (runner.graphs is None) == eager
        assert [layer.attn.kv_scales for layer in runner.model.layers] == scales
        if not eager:
            ours = engine_logprobs(llm)
        outputs[eager] = run_staggered(llm.engine, prompts, TINY_ARRIVALS, GREEDY)
        del llm, runner
        gc.collect()
        torch.cuda.empty_cache()
    assert outputs[False] == outputs[True]
    # the CPU's transformers with K and V through e4m3 at the same scales: fp32 noise may flip a value's rounding here
    # and there (the torch path on the CPU matches it within 2e-6: tests/loader/test_kv_cache_scales.py)
    for engine, reference in zip(ours, reference_logprobs(model, scales)):
        assert (engine - reference).abs().mean() < 1e-3 and (engine - reference).abs().max() < 0.01
    unscaled = reference_logprobs(model, [(1.0, 1.0)] * len(scales))
    assert min((engine - reference).abs().max() for engine, reference in zip(ours, unscaled)) > 0.05
