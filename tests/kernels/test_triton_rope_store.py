"""The fused RoPE + KV store (one launch) against RoPE then store (two launches, and the torch references):
in Triton's interpreter on a CPU, natively on a GPU."""
from __future__ import annotations

import pytest
import torch

from fasterllm.layers.attention import AttentionMetadata, KernelInputs, attend_with_kernels, paged_attention
from fasterllm.layers.attention import store_kv as store_kv_torch
from fasterllm.layers.attention_layer import Attention, norm_heads
from fasterllm.layers.norm import RMSNorm
from fasterllm.layers.rotary import RotaryEmbedding, apply_rotary as apply_rotary_reference, rope_inv_freq
from fasterllm.worker.piecewise_graphs import piecewise_token_sizes

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytest.importorskip("triton")
from fasterllm.kernels.kv_store import store_kv, store_kv_reference  # noqa: E402
from fasterllm.kernels.rotary import apply_rotary, rotary_and_store_kv  # noqa: E402

gpu_only = pytest.mark.skipif(DEVICE.type != "cuda", reason="real model shapes need a GPU")
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


def make_inputs(num_tokens, num_heads, num_kv_heads, head_dim, dtype, block_size, num_blocks, max_positions,
                scaling=None):
    """A fused QKV output, its positions, a full cache and slots with two padding rows (slot -1)."""
    torch.manual_seed(0)
    rotary = RotaryEmbedding(head_dim, max_positions, rope_inv_freq(head_dim, 500000.0, scaling), DEVICE, dtype)
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, device=DEVICE).to(dtype)
    positions = torch.randint(1, max_positions,  # position 0 rotates nothing
                               (num_tokens,), device=DEVICE)
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:num_tokens]
    slots[[1, -1]] = -1
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, device=DEVICE).to(dtype)
    return rotary, qkv, positions, slots, cache


def split(qkv, num_heads, num_kv_heads):
    return qkv.split([num_heads, num_kv_heads, num_kv_heads], dim=1)


def run(num_tokens, num_heads, num_kv_heads, head_dim, dtype, block_size=16, num_blocks=8, max_positions=4096,
        scaling=None, slot_dtype=torch.int64):
    """Fused vs two launches (bit for bit, any dtype) and vs the torch references (bit for bit where the
    rounding is the reference's: fp16 anywhere, bf16 on a GPU; see test_triton_rotary)."""
    rotary, qkv, positions, slots, cache = make_inputs(num_tokens, num_heads, num_kv_heads, head_dim, dtype,
                                                       block_size, num_blocks, max_positions, scaling)
    fused_qkv, fused_cache = qkv.clone(), cache.clone()
    query, key, value = split(fused_qkv, num_heads, num_kv_heads)
    rotary_and_store_kv(query, key, value, positions, rotary.cos_sin, fused_cache[0], fused_cache[1],
                        slots.to(slot_dtype))

    two_qkv, two_cache = qkv.clone(), cache.clone()
    query, key, value = split(two_qkv, num_heads, num_kv_heads)
    apply_rotary(query, key, positions, rotary.cos_sin)
    store_kv(key, value, two_cache[0], two_cache[1], slots.to(slot_dtype))
    assert torch.equal(fused_qkv, two_qkv) and torch.equal(fused_cache, two_cache)

    ref_qkv, ref_cache = qkv.clone(), cache.clone()
    rotated = num_heads + num_kv_heads
    ref_qkv[:, :rotated] = apply_rotary_reference(qkv[:, :rotated], *rotary.cos_sin_for(positions))
    _, key, value = split(ref_qkv, num_heads, num_kv_heads)
    store_kv_reference(key, value, ref_cache[0], ref_cache[1], slots)
    if dtype == torch.float16 or (dtype == torch.bfloat16 and DEVICE.type == "cuda"):
        assert torch.equal(fused_qkv, ref_qkv) and torch.equal(fused_cache, ref_cache)
    else:  # fp32 (torch's addcmul may fuse the sum into one FMA), bf16 in the interpreter (rounded toward zero)
        tolerance = 1e-6 if dtype == torch.float32 else 2 ** -6
        torch.testing.assert_close(fused_qkv, ref_qkv, atol=tolerance, rtol=tolerance)
        torch.testing.assert_close(fused_cache, ref_cache, atol=tolerance, rtol=tolerance)
    kept = slots >= 0
    assert not torch.equal(fused_qkv[~kept], qkv[~kept])  # padding rows' Q/K are rotated all the same
    assert torch.equal(fused_cache[0].flatten(0, 1)[slots[kept]], split(fused_qkv, num_heads, num_kv_heads)[1][kept])
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool, device=DEVICE)
    untouched[slots[kept]] = False
    assert torch.equal(fused_cache.flatten(1, 2)[:, untouched], cache.flatten(1, 2)[:, untouched])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_matches_rotary_then_store(dtype, slot_dtype):
    run(9, 4, 2, 64, dtype, scaling=LLAMA3, slot_dtype=slot_dtype)


@pytest.mark.parametrize("fused", [True, False])
def test_positions_past_the_table_read_its_last_row_not_the_memory_after_it(fused):
    """The piecewise graphs' warm-up runs one sequence of up to 512 tokens (positions 0..511) whatever max_model_len,
    the table's rows (256 in tests/parity/test_gpu_gguf_k_quants.py): rows past the table were read from whatever
    memory followed it (an illegal memory access on an H100 where that was unmapped). Here the table is the first
    rows of a buffer whose next rows are NaN: a position past it reads the last row instead."""
    rows, size, dtype = 256, max(piecewise_token_sizes(8192)), torch.float16
    rotary = RotaryEmbedding(64, rows, rope_inv_freq(64, 10000.0, None), DEVICE, dtype)
    guarded = torch.full((2 * rows, rotary.cos_sin.shape[1]), float("nan"), dtype=dtype, device=DEVICE)
    guarded[:rows] = rotary.cos_sin
    table = guarded[:rows]  # the exact table, NaN after its end
    torch.manual_seed(0)
    qkv = torch.randn(size, 4 + 2 * 2, 64, device=DEVICE).to(dtype)
    cache = torch.zeros(2, 4, 16, 2, 64, dtype=dtype, device=DEVICE)
    positions = torch.arange(size, device=DEVICE)  # what InputBuffers.stage gives one sequence of `size` tokens
    outputs = []
    for where in (positions, positions.clamp(max=rows - 1)):
        rotated = qkv.clone()
        query, key, value = split(rotated, 4, 2)
        if fused:  # slots -1: stored nowhere, as in the warm-up
            rotary_and_store_kv(query, key, value, where, table, cache[0], cache[1],
                                torch.full((size,), -1, device=DEVICE))
        else:
            apply_rotary(query, key, where, table)
        outputs.append(rotated)
    assert size > rows and not outputs[0].isnan().any()
    assert torch.equal(outputs[0], outputs[1])


def test_three_query_heads_per_kv_head_odd_kv_heads_head_dim_96_block_32():
    run(6, 9, 3, 96, torch.float16, block_size=32, num_blocks=2)


def test_mismatched_cache_is_refused():
    rotary, qkv, positions, slots, cache = make_inputs(4, 4, 2, 64, torch.float32, 16, 2, 64)
    query, key, value = split(qkv, 4, 2)
    with pytest.raises(ValueError, match="must share a dtype"):
        rotary_and_store_kv(query, key, value, positions, rotary.cos_sin, cache[0].half(), cache[1].half(), slots)
    with pytest.raises(ValueError, match="slot_mapping must be"):
        rotary_and_store_kv(query, key, value, positions, rotary.cos_sin, cache[0], cache[1], slots.float())
    with pytest.raises(ValueError, match="cos_sin must be"):
        rotary_and_store_kv(query, key, value, positions, rotary.cos_sin[:, :64], cache[0], cache[1], slots)


def decode_and_chunk_meta(block_size: int = 16) -> AttentionMetadata:
    """Both paths' metadata for 5 new tokens: one decode with 20 tokens cached (blocks 3, 1) and a chunk of 4 after 6
    cached (block 0)."""
    query_lens, seq_lens, tables = [1, 4], [20, 10], [[3, 1], [0]]
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size, DEVICE)
    meta.kernel = KernelInputs(torch.tensor([[3, 1], [0, 0]], dtype=torch.int32, device=DEVICE),
                               torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
                               torch.tensor([0, 1, 5], dtype=torch.int32, device=DEVICE), 4)
    return meta


def test_attention_layer_kernels_match_torch_path():
    """attend_with_kernels (fused RoPE + store, then paged attention) against the CPU path of models/llama.py,
    on a batch of one decode (20 tokens cached) and one chunk of 4 new tokens after 6 cached."""
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 32, 16
    rotary, qkv, _, _, cache = make_inputs(5, num_heads, num_kv_heads, head_dim, torch.float32, block_size, 4, 64)
    meta = decode_and_chunk_meta(block_size)
    scale = head_dim ** -0.5
    kernel_cache = cache.clone()
    kernel_out = attend_with_kernels(qkv.clone(), num_heads, num_kv_heads, kernel_cache, meta, rotary.cos_sin, scale)

    rotated = apply_rotary_reference(qkv[:, :num_heads + num_kv_heads], *rotary.cos_sin_for(meta.positions))
    query, key = rotated.split([num_heads, num_kv_heads], dim=1)
    value = qkv[:, num_heads + num_kv_heads:]
    torch_cache = cache.clone()
    store_kv_torch(torch_cache, torch.cat([key, value], dim=1), meta.slot_mapping)
    torch_out = paged_attention(query, key, value, torch_cache, meta, scale)
    torch.testing.assert_close(kernel_cache, torch_cache, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(kernel_out, torch_out, atol=1e-5, rtol=1e-5)


def head_norms(head_dim: int, dtype: torch.dtype) -> tuple[RMSNorm, RMSNorm]:
    """Qwen3's per-head query and key RMSNorms, with weights away from 1."""
    generator = torch.Generator().manual_seed(1)
    norms = RMSNorm(head_dim, 1e-6), RMSNorm(head_dim, 1e-6)
    for norm in norms:
        norm.weight.data = (1 + 0.5 * torch.randn(head_dim, generator=generator)).to(DEVICE, dtype)
        norm.requires_grad_(False)  # as a loaded model's
    return norms


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [32, 80])
def test_head_norms_inside_the_launch_match_the_norms_then_the_launch(dtype, head_dim):
    num_heads, num_kv_heads = 4, 2
    rotary, qkv, positions, slots, cache = make_inputs(6, num_heads, num_kv_heads, head_dim, dtype, 16, 4, 64)
    qkv = qkv * 4  # far from unit RMS: a missing norm shows
    q_norm, k_norm = head_norms(head_dim, dtype)
    fused_qkv, fused_cache = qkv.clone(), cache.clone()
    rotary_and_store_kv(*split(fused_qkv, num_heads, num_kv_heads), positions, rotary.cos_sin, fused_cache[0],
                        fused_cache[1], slots, head_norms=(q_norm.weight, k_norm.weight, q_norm.eps))
    two_qkv, two_cache = norm_heads(qkv, q_norm, k_norm, num_heads, num_kv_heads), cache.clone()
    rotary_and_store_kv(*split(two_qkv, num_heads, num_kv_heads), positions, rotary.cos_sin, two_cache[0],
                        two_cache[1], slots)
    # fp32 sums of squares in another order: bf16 may round the other way (one unit in the last place)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(fused_qkv, two_qkv, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(fused_cache, two_cache, atol=tolerance, rtol=tolerance)


def test_attention_layer_head_norms_kernels_match_torch_path():
    """The attention layer given Qwen3's head norms: inside the rotary launch on the kernel path, before RoPE on the
    torch path; one decode and one chunk, as above."""
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 32, 16
    rotary, qkv, _, _, cache = make_inputs(5, num_heads, num_kv_heads, head_dim, torch.float32, block_size, 4, 64)
    qkv = qkv * 4
    norms = head_norms(head_dim, torch.float32)
    layer = Attention(num_heads, num_kv_heads, head_dim)
    meta = decode_and_chunk_meta(block_size)
    kernel_cache, torch_cache = cache.clone(), cache.clone()
    kernel_out = layer(qkv.clone(), rotary.cos_sin, kernel_cache, meta, norms)
    meta.kernel = None
    torch_out = layer(qkv.clone(), rotary.cos_sin_for(meta.positions), torch_cache, meta, norms)
    torch.testing.assert_close(kernel_cache, torch_cache, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kernel_out, torch_out, atol=1e-5, rtol=1e-5)


@gpu_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [(32, 8, 128), (9, 3, 64)])  # Llama-3-8B, SmolLM2
def test_model_shapes(dtype, heads):
    run(1000, *heads, dtype, num_blocks=128, max_positions=8192, scaling=LLAMA3 if heads[0] == 32 else None)

