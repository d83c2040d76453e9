"""Perplexity of SmolLM2 on a public-domain text (Pride and Prejudice, chapter 1; tests/data) for each
quantization method against the unquantized model, scored by the engine's prompt_logprobs; and
each quantized model still answers the France prompt."""
import math
from pathlib import Path

import pytest

from fasterllm import LLM, SamplingParams

TEXT = (Path(__file__).parent.parent / "data" / "pride_and_prejudice_ch1.txt").read_text()
# how far each method may raise the perplexity, relative to the unquantized model (issue 7). w8a8: its integer sums
# are exact on every path, yet the float work around them moves its result between +0.06% (AVX-512, bf16) and
# +1.2% to +1.6% (fp32, or AVX2-capped kernels): benchmarks/RESULTS.md, "CPUs without AVX-512"
ALLOWED_INCREASE = {"int8": 0.01, "w8a8": 0.02, "int4": 0.05, "gguf": 0.01}
# the fp8 KV cache (e4m3, scale 1): +1.0% with fp32 arithmetic, -0.3% with bf16 on the AVX-512 VM (RESULTS.md)
FP8_KV_ALLOWED_INCREASE = 0.015


def perplexity(llm: LLM) -> float:
    ids = llm.get_tokenizer().encode(TEXT)
    out = llm.generate(ids, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    scored = [entry[token].logprob for token, entry in zip(ids[1:], out.prompt_logprobs[1:])]
    assert len(scored) == len(ids) - 1 > 1000
    return math.exp(-sum(scored) / len(scored))


def make_llm(gguf, quantization: str | None, **engine_args) -> LLM:
    return LLM(str(gguf), quantization=quantization, max_model_len=1280, num_kv_blocks=96, enable_prefix_caching=False,
               **engine_args)


@pytest.fixture(scope="module")
def unquantized_perplexity(gguf) -> float:
    return perplexity(make_llm(gguf, None))


@pytest.mark.parametrize("method", list(ALLOWED_INCREASE))
def test_quantized_perplexity_and_answer(gguf, unquantized_perplexity, method):
    llm = make_llm(gguf, method)
    quantized = perplexity(llm)
    print(f"perplexity: unquantized {unquantized_perplexity:.4f}, {method} {quantized:.4f} "
          f"({quantized / unquantized_perplexity - 1:+.2%})")
    assert math.isfinite(quantized)
    assert quantized <= unquantized_perplexity * (1 + ALLOWED_INCREASE[method])
    reply = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert "Paris" in reply[0].outputs[0].text


def test_fp8_kv_cache_perplexity_and_answer(gguf, unquantized_perplexity):
    """Every attention read goes through the e4m3 values (chunks of 256 read earlier chunks back from the cache)."""
    llm = make_llm(gguf, None, kv_cache_dtype="fp8", max_num_batched_tokens=256)
    fp8 = perplexity(llm)
    print(f"perplexity: KV cache in the model's dtype {unquantized_perplexity:.4f}, fp8 {fp8:.4f} "
          f"({fp8 / unquantized_perplexity - 1:+.2%})")
    assert unquantized_perplexity * 0.97 < fp8 <= unquantized_perplexity * (1 + FP8_KV_ALLOWED_INCREASE)
    reply = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert "Paris" in reply[0].outputs[0].text
