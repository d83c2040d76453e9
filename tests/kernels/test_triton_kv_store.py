"""The Triton KV store against its torch reference: in Triton's interpreter on a CPU, natively on a GPU."""
from __future__ import annotations

import pytest
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytest.importorskip("triton")
from fasterllm.kernels.kv_store import store_kv, store_kv_reference  # noqa: E402

gpu_only = pytest.mark.skipif(DEVICE.type != "cuda", reason="real model shapes need a GPU")


def run_both(num_tokens, num_kv_heads, head_dim, dtype, block_size=16, num_blocks=8, index_dtype=torch.int64):
    """Stores K/V taken as strided views of a fused QKV output, with two padding rows (slot -1)."""
    torch.manual_seed(0)
    num_heads = 2 * num_kv_heads
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, device=DEVICE).to(dtype)
    key, value = qkv[:, num_heads:num_heads + num_kv_heads], qkv[:, num_heads + num_kv_heads:]
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:num_tokens]
    slots[[1, -1]] = -1
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, device=DEVICE).to(dtype)
    caches = [cache, cache.clone()]
    store_kv(key, value, caches[0][0], caches[0][1], slots.to(index_dtype))
    store_kv_reference(key, value, caches[1][0], caches[1][1], slots)
    assert torch.equal(caches[0], caches[1])  # a copy: bit for bit, and nothing else touched
    kept = slots >= 0
    assert torch.equal(caches[0][0].flatten(0, 1)[slots[kept]], key[kept])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_store_matches_reference(dtype, index_dtype):
    run_both(12, 2, 64, dtype, index_dtype=index_dtype)


def test_odd_head_count_and_head_dim():
    run_both(5, 3, 48, torch.float32, block_size=32, num_blocks=2)


def test_bad_slot_mapping_is_refused():
    key = torch.zeros(3, 2, 64, device=DEVICE)
    cache = torch.zeros(4, 16, 2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="slot_mapping must be"):
        store_kv(key, key, cache, cache, torch.zeros(3, device=DEVICE))


@gpu_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_kv_heads, head_dim", [(8, 128), (3, 64)])  # Llama-3-8B, SmolLM2
def test_model_shapes(dtype, num_kv_heads, head_dim):
    run_both(1000, num_kv_heads, head_dim, dtype, num_blocks=128)
