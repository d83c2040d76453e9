"""On a GPU: SmolLM2 (the real GGUF) through the engine with each GPU quantization method. Greedy chat still
answers "Paris", and a request replayed from the decode CUDA graphs gives exactly the eager tokens (every
quantized kernel is capturable and deterministic: split-K partial sums are added in a fixed order).
Skipped without CUDA; fp8 without a Hopper GPU. FASTERLLM_TEST_GGUF names the file when the package is absent."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fasterllm import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
METHODS = ["int8", "int4", "w8a8"] + (["fp8"] if torch.cuda.is_available()
                                      and torch.cuda.get_device_capability()[0] >= 9 else [])
PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):\n    "]


def make_llm(gguf: Path, method: str, eager: bool) -> LLM:
    return LLM(str(gguf), dtype="bfloat16", device="cuda", max_model_len=512, gpu_memory_utilization=0.2,
               quantization=method, enforce_eager=eager, enable_prefix_caching=False)


@pytest.mark.parametrize("method", METHODS)
def test_answers_paris_and_graph_replay_equals_eager(gguf, method):
    greedy = SamplingParams(temperature=0, max_tokens=24)
    graphs = make_llm(gguf, method, eager=False)
    chat = graphs.chat([{"role": "user", "content": "What is the capital of France?"}], greedy, use_tqdm=False)
    assert "Paris" in chat[0].outputs[0].text, chat[0].outputs[0].text
    replayed = [graphs.generate(p, greedy, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]
    del graphs
    torch.cuda.empty_cache()
    eager = make_llm(gguf, method, eager=True)
    assert [eager.generate(p, greedy, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS] == replayed
