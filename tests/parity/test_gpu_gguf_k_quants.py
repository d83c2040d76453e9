"""On a GPU: quantization='gguf' runs a GGUF's Q8_0 / Q5_K / Q6_K projections and head (and fused mixes with Q4_K,
as Q4_K_M's attention) as their stored 8-bit codes through the Triton kernels, with the prompt logprobs of the same
file dequantized to float (fp32: tight; bf16: the dtype's rounding), at one row (gemv), a few and a prefill.
Skipped without CUDA; the CPU twin is tests/loader/test_gguf.py::test_k_quant_projections_and_head_run_as_stored_..."""
from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest
import torch

from fasterllm import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).parents[1] / "loader"))  # test_gguf writes the files
from test_gguf import K_QUANT_FILES, SHAPE, VOCAB, randomized, write_gguf  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from gguf import GGMLQuantizationType  # noqa: E402

# prompt-logprob gaps against the float load on the GPU: fp32 sums in another order through random weights whose
# logits reach +-40 (the CPU measured up to 4e-4); bf16 rounds the activations and the float weights
TOLERANCE = {"float32": 2e-3, "bfloat16": 0.25}


def prompt_logprobs(path, dtype: str, prompt: list[int], **engine_args) -> tuple[torch.Tensor, LLM]:
    llm = LLM(str(path), dtype=dtype, device="cuda", max_model_len=256, gpu_memory_utilization=0.2,
              enable_prefix_caching=False, **engine_args)
    out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    return torch.tensor([entry[token].logprob for token, entry in zip(prompt[1:], out.prompt_logprobs[1:])]), llm


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("file_kind", K_QUANT_FILES)
def test_k_quant_files_run_as_stored_on_the_gpu(tmp_path, file_kind, dtype):
    torch.manual_seed(0)
    model = randomized(LlamaForCausalLM(LlamaConfig(**{**SHAPE, "hidden_size": 256, "intermediate_size": 256},
                                                    rope_theta=10000.0)))
    path = tmp_path / f"tiny-{file_kind}.gguf"
    write_gguf(path, model, GGMLQuantizationType.F32, block_types=K_QUANT_FILES[file_kind])
    prompt = [int(t) for t in torch.randint(0, VOCAB - 1, (100,), generator=torch.Generator().manual_seed(3))]
    floats, llm = prompt_logprobs(path, dtype, prompt)
    del llm
    # a 100-token prefill (dequantize + cuBLAS), chunks of 40 (2-64 rows: the split-K kernel) and decode (gemv)
    blocks, llm = prompt_logprobs(path, dtype, prompt, quantization="gguf")
    chunked, _ = prompt_logprobs(path, dtype, prompt, quantization="gguf", max_num_batched_tokens=40)
    decoder = llm.engine.executor.runner.model
    for linear in (decoder.layers[0].qkv_proj, decoder.layers[1].down_proj, decoder.lm_head):
        assert type(linear).__name__ == "Uint8GroupedGPULinear" and linear.qweight.dtype == torch.uint8
    assert (blocks - floats).abs().max() < TOLERANCE[dtype]
    assert (chunked - floats).abs().max() < TOLERANCE[dtype]
    text = llm.generate([prompt[:20]], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    reference = LLM(str(path), dtype=dtype, device="cuda", max_model_len=256, gpu_memory_utilization=0.2)
    if dtype == "float32":  # greedy decode (one row a step: gemv) picks the float model's tokens
        assert text.outputs[0].token_ids == reference.generate(
            [prompt[:20]], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0].token_ids
    del llm, reference
    gc.collect()
    torch.cuda.empty_cache()
