"""On 2 or 4 GPUs: a model sharded over NCCL answers as it does on one GPU (bf16, CUDA graphs).

A random-weight Llama (peaked weights, 16 query and 4 KV heads, a vocabulary of 32,003 that does not divide) is
run greedy at tensor_parallel_size 1, 2 and (with 4 GPUs) 4. The sums of a row-parallel layer are added in
another order than one GPU adds them, so bf16 tokens are compared as test_gpu_generation compares them with
transformers: identical up to the first difference, and there each side's token among the other's top 5. Decode
steps replayed from CUDA graphs (the NCCL all-reduce captured inside) must give exactly the eager tokens.
Skipped with fewer than 2 GPUs.
"""
from __future__ import annotations

import dataclasses
import gc

import pytest
import torch

from fasterllm import LLM, SamplingParams
from parity_utils import TINY_SPECS, build_tiny_model, random_prompt
from test_gpu_generation import near_tie_agreement

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 or more CUDA GPUs")
pytest.importorskip("transformers")

SPEC = dataclasses.replace(TINY_SPECS[0], name="llama_gpu_tp", num_heads=16, num_kv_heads=4, head_dim=64,
                           vocab_size=32003, extra={"hidden_size": 1024, "num_hidden_layers": 8,
                                                    "intermediate_size": 2816})
PARAMS = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=5)
PROMPTS = [random_prompt(length, SPEC.vocab_size, seed) for seed, length in enumerate((7, 30, 64, 200, 5, 90))]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama_gpu_tp")
    build_tiny_model(SPEC, directory, seed=3)
    return directory


def _generate(directory, prompts=PROMPTS, **kwargs) -> list[tuple[list[int], list[dict]]]:
    llm = LLM(str(directory), dtype="bfloat16", device="cuda", gpu_memory_utilization=0.25, **kwargs)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
    finally:  # its memory back before the next engine sizes its KV cache on the same GPUs
        llm.engine.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outputs]


@pytest.fixture(scope="module")
def one_gpu(checkpoint):
    return _generate(checkpoint)


@pytest.mark.parametrize("size", [2, 4])
def test_sharded_greedy_agrees_with_one_gpu(checkpoint, one_gpu, size):
    if torch.cuda.device_count() < size:
        pytest.skip(f"needs {size} GPUs")
    sharded = _generate(checkpoint, tensor_parallel_size=size)
    for i, ((ours, ours_top), (ref, ref_top)) in enumerate(zip(sharded, one_gpu)):
        assert near_tie_agreement(ours, [set(t) for t in ours_top], ref, [list(t) for t in ref_top]), \
            f"prompt {i}: tp={size} {ours} vs one GPU {ref}"


def test_cuda_graphs_with_the_all_reduce_inside_equal_eager(checkpoint):
    """One request: its decode steps replay a graph of batch size 1, the same kernels as eager."""
    graphed = _generate(checkpoint, PROMPTS[1:2], tensor_parallel_size=2)
    eager = _generate(checkpoint, PROMPTS[1:2], tensor_parallel_size=2, enforce_eager=True)
    assert graphed[0][0] == eager[0][0]
