"""Perplexity of SmolLM2 on a public-domain text (Pride and Prejudice, chapter 1; tests/data) for each
quantization method against the unquantized model, scored by the engine's prompt_logprobs; and
each quantized model still answers the France prompt."""
import copy
import math
import shutil
import sys
from pathlib import Path

import pytest
import torch

from fasterllm import LLM, SamplingParams

TEXT = (Path(__file__).parent.parent / "data" / "pride_and_prejudice_ch1.txt").read_text()
# how far each method may raise the perplexity, relative to the unquantized model (issue 7). w8a8: its integer sums
# are exact on every path, yet the float work around them moves its result between +0.06% (AVX-512, bf16) and
# +1.2% to +1.6% (fp32, or AVX2-capped kernels): benchmarks/RESULTS.md, "CPUs without AVX-512"
ALLOWED_INCREASE = {"int8": 0.01, "w8a8": 0.02, "int4": 0.05, "gguf": 0.01}
sys.path.insert(0, str(Path(__file__).parents[1] / "loader"))  # test_compressed_tensors writes the checkpoints
# compressed-tensors checkpoints of the float model, round-to-nearest (RESULTS.md): W8A8 +1.16% with bf16, +2.12% with
# fp32 on the AVX2 path (its down_proj takes int8 activations too, as our w8a8's does not), W8A16 +0.12% / +0.33%. No
# 4-bit scheme here: this float model is a Q4_1 file's grid, which 4-bit codes with integer zero points cannot hold
# (+19% for W4A16 g32)
COMPRESSED_ALLOWED_INCREASE = {"W8A8": 0.03, "W8A16": 0.005}
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


@pytest.fixture(scope="module")
def smollm2_hf(tmp_path_factory, hf_smollm2, hf_smollm2_tokenizer):
    """SmolLM2 as a float Hugging Face model and directory (transformers' reading of the GGUF, which it will not save
    itself), and the directory's perplexity."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(hf_smollm2.config)
    config.__dict__.pop("quantization_config", None)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.load_state_dict(hf_smollm2.state_dict())
    directory = tmp_path_factory.mktemp("smollm2_hf")
    model.save_pretrained(directory)
    hf_smollm2_tokenizer.save_pretrained(directory)
    return model, directory, perplexity(LLM(str(directory), max_model_len=1280, num_kv_blocks=96,
                                            enable_prefix_caching=False))


@pytest.mark.parametrize("scheme", list(COMPRESSED_ALLOWED_INCREASE))
def test_compressed_tensors_perplexity(tmp_path, smollm2_hf, scheme):
    """SmolLM2 written by compressed-tensors (round-to-nearest scales from each weight's min/max, no calibration data),
    run as stored, against the float directory it was made from."""
    from test_compressed_tensors import SCHEMES, write_compressed

    model, directory, float_perplexity = smollm2_hf
    for path in directory.iterdir():
        shutil.copy(path, tmp_path / path.name)
    scheme_args, quantization_format = SCHEMES[scheme][:2]
    write_compressed(tmp_path, copy.deepcopy(model), scheme_args, quantization_format)
    llm = LLM(str(tmp_path), max_model_len=1280, num_kv_blocks=96, enable_prefix_caching=False)
    stored = perplexity(llm)
    print(f"perplexity: float {float_perplexity:.4f}, compressed-tensors {scheme} {stored:.4f} "
          f"({stored / float_perplexity - 1:+.2%})")
    assert float_perplexity * 0.99 < stored <= float_perplexity * (1 + COMPRESSED_ALLOWED_INCREASE[scheme])
