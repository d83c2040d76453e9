"""The fp8 KV cache in the Triton kernels (store, fused RoPE + store, paged attention) against the torch path and
references: in Triton's interpreter on a CPU, natively on a GPU."""
from __future__ import annotations

import pytest
import torch

from fasterllm.layers.attention import attend_with_kernels, paged_attention
from fasterllm.layers.attention import store_kv as store_kv_torch
from fasterllm.layers.kv_cache_dtype import FP8_KV_DTYPE, FP8_MAX, cache_values
from fasterllm.layers.rotary import RotaryEmbedding, rope_inv_freq

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytest.importorskip("triton")
from fasterllm.kernels.kv_store import store_kv, store_kv_reference  # noqa: E402
from fasterllm.kernels.paged_attention import paged_attention as paged_attention_kernel  # noqa: E402
from fasterllm.kernels.paged_attention import paged_attention_reference  # noqa: E402
from fasterllm.kernels.rotary import apply_rotary, rotary_and_store_kv  # noqa: E402
from test_triton_rope_store import decode_and_chunk_meta  # noqa: E402

# dtypes the interpreter computes as the GPU does (its bf16 arithmetic rounds differently: bf16 runs on a GPU)
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
SCALES = (0.5, 0.03)  # (k_scale, v_scale): V's pushes values past +-448, so saturation shows


def fp8_cache(num_blocks, block_size, num_kv_heads, head_dim, seed=0):
    """A cache of random e4m3 values (every slot filled, so a wrong read or write shows)."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=generator) * 4
    return values.to(FP8_KV_DTYPE).to(DEVICE)


def kv_rows(num_tokens, num_kv_heads, head_dim, dtype):
    """K/V rows as strided views of a fused output, with values on the tops of binades (7.99 rounds up to 8: the
    interpreter's own cast gets these wrong) and past the fp8 range."""
    torch.manual_seed(0)
    kv = torch.randn(num_tokens, 2 * num_kv_heads, head_dim) * 6
    kv[0, 0, :4] = torch.tensor([7.99, -3.999, 15.97, 1e4])
    kv = torch.cat([torch.zeros(num_tokens, 1, head_dim), kv], dim=1).to(dtype).to(DEVICE)
    return kv[:, 1:1 + num_kv_heads], kv[:, 1 + num_kv_heads:]


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_writes_the_scaled_e4m3_values(dtype):
    key, value = kv_rows(10, 2, 64, dtype)
    slots = torch.randperm(4 * 16, device=DEVICE)[:10]
    slots[3] = -1
    cache = fp8_cache(4, 16, 2, 64)
    kernel_cache, reference_cache = cache.clone(), cache.clone()
    store_kv(key, value, kernel_cache[0], kernel_cache[1], slots, *SCALES)
    store_kv_reference(key, value, reference_cache[0], reference_cache[1], slots, *SCALES)
    assert torch.equal(kernel_cache.view(torch.uint8), reference_cache.view(torch.uint8))
    kept = slots >= 0
    stored_k = kernel_cache[0].flatten(0, 1).view(torch.uint8)[slots[kept]].view(FP8_KV_DTYPE)
    assert torch.equal(stored_k.float(), (key[kept].float() / SCALES[0]).clamp(-FP8_MAX, FP8_MAX)
                       .to(FP8_KV_DTYPE).float())
    assert kernel_cache[1].float().abs().max() == FP8_MAX  # V over its scale saturates instead of overflowing
    assert float(stored_k.float()[0, 0, 0]) == 16.0  # 7.99 / 0.5 rounds up to the next binade


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_rotary_store_equals_rotary_then_store_and_the_torch_path(dtype):
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 64, 16
    rotary = RotaryEmbedding(head_dim, 256, rope_inv_freq(head_dim, 10000.0, None), DEVICE, dtype)
    key, value = kv_rows(9, num_kv_heads, head_dim, dtype)
    query = torch.randn(9, num_heads, head_dim, device=DEVICE).to(dtype)
    qkv = torch.cat([query, key, value], dim=1)
    positions = torch.randint(1, 256, (9,), device=DEVICE)
    slots = torch.randperm(4 * block_size, device=DEVICE)[:9]
    cache = fp8_cache(4, block_size, num_kv_heads, head_dim)

    fused_qkv, fused_cache = qkv.clone(), cache.clone()
    q, k, v = fused_qkv.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    rotary_and_store_kv(q, k, v, positions, rotary.cos_sin, fused_cache[0], fused_cache[1], slots, *SCALES)
    two_qkv, two_cache = qkv.clone(), cache.clone()
    q, k, v = two_qkv.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    apply_rotary(q, k, positions, rotary.cos_sin)
    store_kv(k, v, two_cache[0], two_cache[1], slots, *SCALES)
    assert torch.equal(fused_qkv, two_qkv)
    assert torch.equal(fused_cache.view(torch.uint8), two_cache.view(torch.uint8))
    torch_cache = cache.clone()  # the CPU path's store, from the same rotated K
    store_kv_torch(torch_cache, two_qkv[:, num_heads:], slots, SCALES)
    assert torch.equal(fused_cache.view(torch.uint8), torch_cache.view(torch.uint8))


def batch(context_lens, query_lens, num_heads=4, num_kv_heads=2, head_dim=64, block_size=16):
    """An fp8 cache, shuffled block tables and fp32 queries; returns the kernel's arguments."""
    generator = torch.Generator().manual_seed(1)
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    needed = [-(-n // block_size) for n in seq_lens]
    order = torch.randperm(sum(needed) + 2, generator=generator).tolist()
    tables = torch.zeros(len(seq_lens), max(needed) + 1, dtype=torch.int32)
    for i, n in enumerate(needed):
        tables[i, :n] = torch.tensor([order.pop() for _ in range(n)], dtype=torch.int32)
    cache = fp8_cache(sum(needed) + 2, block_size, num_kv_heads, head_dim)
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=generator)
    return dict(query=query.to(DEVICE), key_cache=cache[0], value_cache=cache[1], block_tables=tables.to(DEVICE),
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
                query_start_loc=torch.tensor([0] + query_lens).cumsum(0).to(torch.int32).to(DEVICE),
                max_query_len=max(query_lens), scale=head_dim ** -0.5)


@pytest.mark.parametrize("query_dtype", [torch.float32] + ([torch.bfloat16] if DEVICE.type == "cuda" else []))
@pytest.mark.parametrize("splits", [None, 1, 3])
@pytest.mark.parametrize("causal", [True, False])
def test_attention_over_an_fp8_cache_matches_the_dequantized_reference(splits, causal, query_dtype):
    """A prompt, chunks over cached context (one past a whole key tile) and two decodes (mixed) or decodes alone
    (split keys); causal, and cross-attention's non-causal form. bf16 queries (a GPU: they multiply the cache's values
    in fp16) too."""
    lens = ([0, 19, 40, 90, 5], [20, 7, 1, 12, 1]) if splits is None else ([0, 150, 33], [1, 1, 1])
    args = batch(*lens)
    got = paged_attention_kernel(**{**args, "query": args["query"].to(query_dtype)}, causal=causal,
                                 num_kv_splits=splits, k_scale=SCALES[0], v_scale=SCALES[1])
    expected = paged_attention_reference(**args, causal=causal, k_scale=SCALES[0], v_scale=SCALES[1])
    tolerance = 1e-4 if query_dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected, atol=tolerance, rtol=tolerance)
    unscaled = paged_attention_reference(**args, causal=causal)
    assert (unscaled - expected).abs().max() > 0.01  # the scales were applied


def test_attention_layer_kernels_match_the_torch_path_on_an_fp8_cache():
    """attend_with_kernels (fused RoPE + fp8 store, attention) against layers/attention.py's CPU path over the same
    fp8 cache: one decode with 20 tokens cached and a chunk of 4 after 6."""
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 32, 16
    rotary = RotaryEmbedding(head_dim, 64, rope_inv_freq(head_dim, 10000.0, None), DEVICE, torch.float32)
    qkv = torch.randn(5, num_heads + 2 * num_kv_heads, head_dim, device=DEVICE) * 3
    cache = fp8_cache(4, block_size, num_kv_heads, head_dim)
    meta = decode_and_chunk_meta(block_size)
    scale = head_dim ** -0.5
    kernel_cache = cache.clone()
    kernel_out = attend_with_kernels(qkv.clone(), num_heads, num_kv_heads, kernel_cache, meta, rotary.cos_sin, scale,
                                     kv_scales=SCALES)

    rotated = qkv.clone()
    q, k, _ = rotated.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    apply_rotary(q, k, meta.positions, rotary.cos_sin)
    torch_cache = cache.clone()
    store_kv_torch(torch_cache, rotated[:, num_heads:], meta.slot_mapping, SCALES)
    assert torch.equal(kernel_cache.view(torch.uint8), torch_cache.view(torch.uint8))
    # the torch path reads every key from the cache here (both sequences have cached context)
    torch_out = paged_attention(q, None, None, torch_cache, meta, scale, kv_scales=SCALES)
    torch.testing.assert_close(kernel_out, torch_out, atol=1e-4, rtol=1e-4)


def test_cache_values_round_to_nearest_even_and_saturate():
    x = torch.tensor([0.0, 1.0625, 1.1875, 500.0, -1e9, 0.0012])  # ties to even; the last: subnormal 2^-9
    assert cache_values(x, 1.0, FP8_KV_DTYPE).float().tolist() == [0.0, 1.0, 1.25, 448.0, -448.0, 2 ** -9]
    assert cache_values(x, 2.0, torch.bfloat16).dtype == torch.bfloat16  # other caches: the values as they are
