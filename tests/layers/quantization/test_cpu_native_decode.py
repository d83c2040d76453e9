"""Greedy decode of SmolLM2 (the default model, fp32) with quantization "gguf" and "int8" on our C++ CPU kernels, for
each ISA this CPU runs, against the same engine whose layers multiply the same quantized weights, unpacked from our
tiles to a dense fp32 matrix, with torch's fp32 matmul: our kernels multiply the inputs as they come, so the two
differ only in the order of fp32 sums and must choose the same tokens with the same logprobs (prefill rows and decode
rows alike; our decode steps run every layer in one C++ call, models/llama_cpu_decode.py, the reference's the Python
layers)."""
import os
import shutil

import pytest
import torch

from fasterllm import LLM, SamplingParams
from fasterllm.kernels.native import cpu_extension, cpu_gemv

if shutil.which(os.environ.get("CXX", "c++")) is None:
    pytest.skip("no C++ compiler: the C++ CPU kernels cannot be built here", allow_module_level=True)

PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "def fibonacci(n):"]
ISAS = [pytest.param(isa, marks=pytest.mark.skipif(isa not in cpu_extension.supported_isas(),
                                                   reason=f"this CPU cannot run the {isa} kernels"))
        for isa in cpu_extension.ISA_FLAGS]
# fp32 sums in another order: logprobs measured apart by at most 5.4e-5 here (gguf and int8, AVX-512)
LOGPROB_TOLERANCE = 1e-3


def dense_int4(weights: cpu_gemv.Int4Weights) -> torch.Tensor:
    """pack_int4's tiles back to the fp32 weight [N, K] (code * scale + minimum)."""
    tiles, blocks = weights.codes.shape[:2]
    packed = weights.codes.reshape(tiles, blocks, 4, 16, 4)  # [tile, block, chunk, row, byte]
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1)  # k = 32 block + 8 chunk + 2 byte + nibble
    codes = codes.permute(0, 3, 1, 2, 4, 5).reshape(tiles * 16, blocks * 32).float()
    per_group = [v.float().transpose(1, 2).reshape(tiles * 16, blocks).repeat_interleave(32, dim=1)
                 for v in (weights.scales, weights.minimums)]
    return (codes * per_group[0] + per_group[1])[:weights.rows]


def dense_int8(weights: cpu_gemv.Int8Weights) -> torch.Tensor:
    """pack_int8's tiles back to the fp32 weight [N, K] (weight * row scale)."""
    tiles, blocks = weights.codes.shape[:2]
    codes = weights.codes.reshape(tiles, blocks, 32, 16).permute(0, 3, 1, 2).reshape(tiles * 16, blocks * 32)
    return (codes.float() * weights.scales.reshape(-1, 1))[:weights.rows]


def greedy(llm: LLM):
    """Per prompt: the tokens and, per step, {token: logprob} of the 5 likeliest."""
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, logprobs=5), use_tqdm=False)
    return [(o.outputs[0].token_ids, [{t: entry[t].logprob for t in entry} for entry in o.outputs[0].logprobs])
            for o in outs]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("method", ["gguf", "int8"])
def test_greedy_decode_is_the_fp32_product_of_the_same_weights(gguf, method, isa, monkeypatch):
    monkeypatch.setenv(cpu_extension.ISA_ENV, isa)
    cpu_extension.kernel_isa.cache_clear()
    try:
        llm = LLM(str(gguf), quantization=method, dtype="float32", max_model_len=256, num_kv_blocks=64,
                  enable_prefix_caching=False)  # the reference must compute every prompt again
        model = llm.engine.executor.runner.model
        assert model.layers[0].qkv_proj.native is not None
        assert model.cpu_decode_stack is not None  # one sequence's decode steps: every layer in one C++ call
        ours = greedy(llm)
        dense: dict[int, torch.Tensor] = {}  # by id of the packed weights

        def reference(unpack):
            def product(x, weights, isa=None, int8_inputs=False):
                if id(weights) not in dense:
                    dense[id(weights)] = unpack(weights)
                return (x.float() @ dense[id(weights)].t()).to(x.dtype)
            return product

        monkeypatch.setattr(cpu_gemv, "int4_gemv", reference(dense_int4))
        monkeypatch.setattr(cpu_gemv, "int8_gemv", reference(dense_int8))
        monkeypatch.setattr(model, "cpu_decode_stack", None)  # the Python layers, which call the products above
        want = greedy(llm)
        assert dense  # the reference ran
    finally:
        monkeypatch.undo()
        cpu_extension.kernel_isa.cache_clear()
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(ours, want):
        assert tokens == want_tokens
        for step, want_step in zip(logprobs, want_logprobs):
            assert step.keys() == want_step.keys()
            assert all(abs(step[t] - want_step[t]) < LOGPROB_TOLERANCE for t in step)
