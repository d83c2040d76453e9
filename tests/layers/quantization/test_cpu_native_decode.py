"""Greedy decode of SmolLM2 (the default model) with quantization "gguf" and "int8" on our C++ CPU kernels, for
each ISA this CPU runs, against the same engine on torch's kernels (FASTERLLM_CPU_KERNELS=off): our kernels round
each input to int8 per block of 32 where torch's round it to bf16, so the two agree token for token until a
near-tie, where the token we chose is within LOGPROB_TOLERANCE of the torch path's choice by its own logprobs, and
the logprobs of the tokens both chose agree within it."""
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
# torch's int8 kernel, the head of both methods, returns bf16-rounded logits: steps of 0.125 where |logit| is 16-32,
# so the torch path's logprobs are only that precise. Measured (fp32 model, this test's prompts): chosen tokens'
# logprobs apart by at most 0.31 (gguf) and 0.18 (int8); at a parting, the two choices 0 to 0.375 apart
LOGPROB_TOLERANCE = 0.5


def greedy(gguf, method: str, kernels: str, monkeypatch):
    """Per prompt: the tokens and, per step, {token: logprob} of the 5 likeliest, FASTERLLM_CPU_KERNELS=kernels."""
    monkeypatch.setenv(cpu_extension.ISA_ENV, kernels)
    cpu_extension.kernel_isa.cache_clear()
    try:
        llm = LLM(str(gguf), quantization=method, dtype="float32", max_model_len=256, num_kv_blocks=64)
        layer = llm.engine.executor.runner.model.layers[0].qkv_proj  # Int4WeightOnlyLinear, Int8WeightOnlyLinear
        assert (layer.native is not None) == (kernels != "off")
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, logprobs=5), use_tqdm=False)
    finally:
        monkeypatch.delenv(cpu_extension.ISA_ENV)
        cpu_extension.kernel_isa.cache_clear()
    return [(o.outputs[0].token_ids, [{t: entry[t].logprob for t in entry} for entry in o.outputs[0].logprobs])
            for o in outs]


@pytest.fixture(scope="module")
def torch_path(gguf):
    with pytest.MonkeyPatch.context() as monkeypatch:
        return {method: greedy(gguf, method, "off", monkeypatch) for method in ("gguf", "int8")}


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("method", ["gguf", "int8"])
def test_greedy_decode_matches_the_torch_path(gguf, torch_path, method, isa, monkeypatch):
    agreed = 0
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(greedy(gguf, method, isa, monkeypatch),
                                                                 torch_path[method]):
        for ours, theirs, step, want_step in zip(tokens, want_tokens, logprobs, want_logprobs):
            if ours != theirs:  # a near-tie by the torch path's own logprobs; the texts part here
                assert ours in want_step and want_step[theirs] - want_step[ours] < LOGPROB_TOLERANCE, (ours, theirs)
                break
            assert abs(step[ours] - want_step[theirs]) < LOGPROB_TOLERANCE
            agreed += 1
    assert agreed >= 16  # measured: 24 (int8) and 29 (gguf) of the 72 tokens before each prompt's parting
