"""One sequence's decode attention in C++ (kernels/native/cpu_attention.py) against the torch path of
layers/attention.py (gathered blocks, SDPA): GQA groups, blocks in any order or consecutive, a key window starting
past 0, keys across several blocks; fp32 to fp32 rounding, bf16 to a bf16 step. Bad block ids are refused by name.
And a bf16 model decoding one sequence through it answers as through the torch path."""
from __future__ import annotations

import pytest
import torch

from fasterllm.kernels.native import cpu_attention, cpu_extension
from fasterllm.layers import attention

pytestmark = pytest.mark.skipif(not cpu_extension.available(), reason="needs the C++ CPU kernels (a compiler, AVX2)")

BLOCK_SIZE, NUM_BLOCKS = 16, 12


def _reference(query, kv_cache, blocks, keys, scale):
    """The torch path's decode attention over the same blocks and keys."""
    block_ids = torch.arange(blocks.start, blocks.stop) if isinstance(blocks, slice) else blocks
    group = attention.DecodeGroup(None, block_ids, None, keys, [keys.stop - 1])
    return attention._decode_attention(query[None], kv_cache, group, scale, None, (1.0, 1.0))[0]


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (8, 8, 128), (32, 4, 64)])
@pytest.mark.parametrize("blocks, keys", [
    (slice(3, 5), slice(0, 17)),  # consecutive blocks, read in place
    (torch.tensor([7, 2, 9, 0, 11]), slice(0, 70)),  # any order
    (torch.tensor([5, 1, 8]), slice(20, 41)),  # a sliding window: the first keys skipped
    (slice(0, 1), slice(0, 1)),  # the first token
])
def test_equals_the_torch_path(dtype, tolerance, heads, kv_heads, head_dim, blocks, keys):
    generator = torch.Generator().manual_seed(heads + head_dim)
    kv_cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, kv_heads, head_dim, generator=generator).to(dtype)
    query = torch.randn(heads, head_dim, generator=generator).to(dtype)
    scale = head_dim ** -0.5
    ours = cpu_attention.decode_attention(query, kv_cache, blocks, keys, scale)
    expected = _reference(query, kv_cache, blocks, keys, scale)
    assert ours.dtype == dtype and ours.shape == (heads, head_dim)
    torch.testing.assert_close(ours.float(), expected.float(), rtol=tolerance, atol=tolerance)


def test_a_block_id_outside_the_cache_is_refused():
    kv_cache = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, 2, 64, dtype=torch.bfloat16)
    query = torch.zeros(4, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="block id 12 is outside the cache's 12 blocks"):
        cpu_attention.decode_attention(query, kv_cache, torch.tensor([3, 12]), slice(0, 20), 0.125)
    with pytest.raises(RuntimeError, match="blocks 11..13 are outside the cache's 12 blocks"):
        cpu_attention.decode_attention(query, kv_cache, slice(11, 13), slice(0, 20), 0.125)


def test_a_bf16_model_decodes_as_through_the_torch_path(monkeypatch, gguf):
    """SmolLM2 in bf16, one sequence greedy: the same tokens, logprobs within bf16 noise, with and without it."""
    from fasterllm import LLM, SamplingParams

    llm = LLM(str(gguf), dtype="bfloat16", device="cpu")
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=1, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(200, 240))}
    calls = []
    runs = cpu_attention.runs
    monkeypatch.setattr(cpu_attention, "runs", lambda q, kv: calls.append(runs(q, kv)) or calls[-1])
    ours = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert any(calls), "no decode step ran the C++ attention"
    monkeypatch.setattr(cpu_attention, "runs", lambda q, kv: False)
    torch_path = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert ours.token_ids == torch_path.token_ids
    for step_ours, step_ref in zip(ours.logprobs, torch_path.logprobs):
        for token, logprob in step_ref.items():
            assert abs(step_ours[token].logprob - logprob.logprob) < 0.1
