"""Greedy decode of SmolLM2 (the default model) with quantization "gguf" and "int8" on our C++ CPU kernels, for
each ISA this CPU runs, against the same engine on torch's kernels (FASTERLLM_CPU_KERNELS=off): the same tokens,
and the chosen tokens' logprobs close (our kernels round each input to int8 per block of 32; torch's to bf16)."""
import os
import shutil

import pytest

from fasterllm import LLM, SamplingParams
from fasterllm.kernels.native import cpu_extension

if shutil.which(os.environ.get("CXX", "c++")) is None:
    pytest.skip("no C++ compiler: the C++ CPU kernels cannot be built here", allow_module_level=True)

PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "def fibonacci(n):"]
ISAS = [pytest.param(isa, marks=pytest.mark.skipif(isa not in cpu_extension.supported_isas(),
                                                   reason=f"this CPU cannot run the {isa} kernels"))
        for isa in cpu_extension.ISA_FLAGS]
LOGPROB_TOLERANCE = 0.1  # measured: at most 0.05 (RESULTS.md, issue 27 item 4)


def greedy(gguf, method: str, kernels: str, monkeypatch):
    """Tokens and their logprobs of each prompt, the layers built with FASTERLLM_CPU_KERNELS=kernels."""
    monkeypatch.setenv(cpu_extension.ISA_ENV, kernels)
    cpu_extension.kernel_isa.cache_clear()
    try:
        llm = LLM(str(gguf), quantization=method, dtype="float32", max_model_len=256, num_kv_blocks=64)
        layer = llm.engine.executor.runner.model.layers[0].qkv_proj  # Int4WeightOnlyLinear, Int8WeightOnlyLinear
        assert (layer.native is not None) == (kernels != "off")
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, logprobs=0), use_tqdm=False)
    finally:
        monkeypatch.delenv(cpu_extension.ISA_ENV)
        cpu_extension.kernel_isa.cache_clear()
    return [(o.outputs[0].token_ids, [entry[t].logprob for t, entry in zip(o.outputs[0].token_ids,
                                                                             o.outputs[0].logprobs)]) for o in outs]


@pytest.fixture(scope="module")
def torch_path(gguf):
    with pytest.MonkeyPatch.context() as monkeypatch:
        return {method: greedy(gguf, method, "off", monkeypatch) for method in ("gguf", "int8")}


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("method", ["gguf", "int8"])
def test_greedy_decode_matches_the_torch_path(gguf, torch_path, method, isa, monkeypatch):
    ours = greedy(gguf, method, isa, monkeypatch)
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(ours, torch_path[method]):
        assert tokens == want_tokens
        assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs)) < LOGPROB_TOLERANCE
