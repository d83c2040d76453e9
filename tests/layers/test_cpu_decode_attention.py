"""One sequence's CPU decode attention in one C++ call (kernels/native/cpu_attention.py) against the torch path it
replaces (SDPA over the gathered blocks): bf16 within a bf16 rounding, fp32 within 1e-5, over consecutive and
scattered blocks, a sliding window's key range, GQA groups and several head dims; and where the layer takes it. A
decode batch's call gives each row what the one-sequence call gives it."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fasterllm.kernels.native import cpu_attention, cpu_extension
from fasterllm.layers.attention import AttentionMetadata, paged_attention

pytestmark = pytest.mark.skipif(not cpu_extension.available(), reason="needs the C++ CPU extension (a compiler)")

BLOCK = 16


def reference(query, kv_cache, blocks, keys, scale):
    """SDPA in fp32 over the sequence's keys, gathered."""
    kv = kv_cache[:, blocks].reshape(2, -1, *kv_cache.shape[-2:])[:, keys].transpose(1, 2).float()  # [2, Hkv, n, D]
    num_heads, head_dim = query.shape
    q = query.float().view(kv.shape[1], num_heads // kv.shape[1], 1, head_dim)
    return F.scaled_dot_product_attention(q, kv[0][:, None], kv[1][:, None], scale=scale).reshape(num_heads, head_dim)


def one_sequence(query, kv_cache, blocks, keys, scale):
    """cpu_attention.decode_attention for one sequence's query [Hq, D] over its keys (a slice) of its blocks (ids, or
    a slice of consecutive ones) -> [Hq, D]."""
    ids = torch.arange(blocks.start, blocks.stop) if isinstance(blocks, slice) else torch.as_tensor(blocks)
    ranges = torch.tensor([[keys.start, keys.stop]])
    return cpu_attention.decode_attention(query[None], kv_cache, ids.view(1, -1), ranges, scale)[0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (32, 8, 128), (4, 4, 96)])
@pytest.mark.parametrize("keys", [slice(0, 1), slice(0, 37), slice(21, 230)])  # one key, a block edge, a window
@pytest.mark.parametrize("scattered", [False, True])
def test_matches_sdpa_over_the_gathered_keys(dtype, heads, kv_heads, head_dim, keys, scattered):
    generator = torch.Generator().manual_seed(heads + keys.stop)
    num_blocks = 20
    cache = torch.randn(2, num_blocks, BLOCK, kv_heads, head_dim, generator=generator).to(dtype)
    query = torch.randn(heads, head_dim, generator=generator).to(dtype)
    needed = -(-keys.stop // BLOCK)
    blocks = torch.randperm(num_blocks, generator=generator)[:needed] if scattered else slice(3, 3 + needed)
    got = one_sequence(query, cache, blocks, keys, head_dim ** -0.5)
    expected = reference(query, cache, blocks, keys, head_dim ** -0.5)
    assert got.dtype == dtype and got.shape == query.shape
    tolerance = 8e-3 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.float(), expected, atol=tolerance, rtol=tolerance)


def test_a_block_outside_the_cache_is_refused_naming_it():
    cache = torch.zeros(2, 4, BLOCK, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="block id 9 is outside the cache's 4"):
        one_sequence(torch.zeros(4, 64, dtype=torch.bfloat16), cache, torch.tensor([1, 9]), slice(0, 20), 0.125)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_layer_takes_it_for_one_sequence_in_bf16_and_fp32(monkeypatch, dtype):
    """The decode of one sequence goes through the C++ call for bf16 and fp32 models, with the torch path's output."""
    generator = torch.Generator().manual_seed(1)
    cache = torch.randn(2, 8, BLOCK, 2, 64, generator=generator).to(dtype)
    query = torch.randn(1, 4, 64, generator=generator).to(dtype)
    meta = AttentionMetadata.build([1], [40], [[5, 2, 7]], BLOCK, torch.device("cpu"))
    calls = []
    real = cpu_attention.decode_attention
    monkeypatch.setattr(cpu_attention, "decode_attention", lambda *args: calls.append(1) or real(*args))
    got = paged_attention(query, None, None, cache, meta, 0.125)
    monkeypatch.setattr(cpu_attention, "runs", lambda *args: False)
    torch_path = paged_attention(query, None, None, cache, meta, 0.125)
    assert calls
    tolerance = 8e-3 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.float(), torch_path.float(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("heads, kv_heads", [(9, 3), (4, 4)])
def test_a_decode_batch_gives_each_row_what_it_gets_alone(monkeypatch, dtype, window, heads, kv_heads):
    """Rows of different lengths over scattered blocks (a window cutting some), as paged_attention hands a decode
    batch to the C++ call: each row's output is what the call gives it alone, to the bit, and near SDPA's padded
    batch."""
    generator = torch.Generator().manual_seed(heads)
    cache = torch.randn(2, 12, BLOCK, kv_heads, 64, generator=generator).to(dtype)
    lens, tables = [40, 7, 33, 16], [[5, 2, 7], [9], [1, 3, 11], [0]]
    meta = AttentionMetadata.build([1] * 4, lens, tables, BLOCK, torch.device("cpu"), window)
    query = torch.randn(4, heads, 64, generator=generator).to(dtype)
    got = paged_attention(query, None, None, cache, meta, 0.125)
    alone = [one_sequence(query[i], cache, tables[i], slice(0 if window is None else max(0, n - window), n), 0.125)
             for i, n in enumerate(lens)]
    assert torch.equal(got.view(4, heads, 64), torch.stack(alone))
    monkeypatch.setattr(cpu_attention, "runs", lambda *args: False)
    sdpa = paged_attention(query, None, None, cache, meta, 0.125)  # the torch path: one padded SDPA batch
    tolerance = 8e-3 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.float(), sdpa.float(), atol=tolerance, rtol=tolerance)


def test_a_decode_batch_with_a_block_outside_the_cache_is_refused_naming_its_row():
    cache = torch.zeros(2, 4, BLOCK, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="row 1's block id 9 is outside the cache's 4"):
        cpu_attention.decode_attention(torch.zeros(2, 4, 64, dtype=torch.bfloat16), cache,
                                       torch.tensor([[1, 2], [9, 0]]), torch.tensor([[0, 20], [0, 20]]), 0.125)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens, stored", [(1, 1), (5, 3)])  # a decode row; a batch with padding rows
def test_rotary_and_store_in_one_call_give_the_torch_paths_bits(dtype, tokens, stored):
    from fasterllm.layers.attention import store_kv
    from fasterllm.layers.rotary import apply_rotary, rotary_embedding

    generator = torch.Generator().manual_seed(tokens)
    heads, kv_heads, head_dim = 9, 3, 64
    rotary = rotary_embedding(head_dim, 512, 10000.0, None, None, torch.device("cpu"), dtype)
    cos, sin = rotary.cos_sin_for(torch.tensor([7, 300, 41, 0, 511][:tokens]))
    qkv = (torch.randn(tokens, heads + 2 * kv_heads, head_dim, generator=generator) * 3).to(dtype)
    slots = torch.tensor([5, 70, 33][:stored])
    cache = torch.randn(2, 6, BLOCK, kv_heads, head_dim, generator=generator).to(dtype)
    expected_qkv, expected_cache = qkv.clone(), cache.clone()
    qk = expected_qkv[:, :heads + kv_heads]
    apply_rotary(qk, cos, sin, out=qk)
    store_kv(expected_cache, expected_qkv[:, heads:], slots)
    cpu_attention.rotary_store(qkv, cos, sin, cache, slots, heads)
    assert torch.equal(qkv, expected_qkv) and torch.equal(cache, expected_cache)
    with pytest.raises(RuntimeError, match="slot 96 is outside the cache's 96"):
        cpu_attention.rotary_store(qkv, cos, sin, cache, torch.tensor([96]), heads)
