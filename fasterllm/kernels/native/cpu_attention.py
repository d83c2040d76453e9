"""A decode step's attention on the CPU in C++ (built by cpu_extension.py, AVX2 code): RoPE on Q and K with the K/V
store in one call (cpu/rotary_store.cpp, the same bits as the torch path's five ops), and a decode batch's attention,
each sequence over its own paged KV blocks, in one call (cpu/decode_attention.cpp). The torch path
(layers/attention.py) views or gathers the sequences' blocks and calls SDPA, about 20-25 us a layer for SmolLM2's
three KV heads and a few hundred keys; the C++ call reads the blocks in place in about half that
(benchmarks/RESULTS.md, fifteenth session).

bf16 and fp32 models: it sums in another order than SDPA and takes exp2 from a polynomial (relative error under
2e-7), which an fp32 model sees against transformers' own; in bf16 the outputs agree to a bf16 rounding
(tests/layers/test_cpu_decode_attention.py)."""
from __future__ import annotations

import torch

from fasterllm.kernels.native import cpu_extension

HEAD_DIMS = (64, 80, 96, 128, 256)  # decode_attention.cpp's


def runs(query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether layers/attention.py hands a decode batch to decode_attention: _takes, and a head dimension it runs."""
    return query.shape[-1] in HEAD_DIMS and _takes(query, kv_cache)


def _takes(x: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """A bf16 or fp32 tensor on the CPU beside a contiguous cache of its dtype, and the extension built."""
    return (x.dtype in (torch.bfloat16, torch.float32) and kv_cache.dtype == x.dtype and x.device.type == "cpu"
            and kv_cache.is_contiguous() and cpu_extension.available())


def decode_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, key_ranges: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """query [B, Hq, D] (each row's heads contiguous) of a decode batch's new tokens -> [B, Hq, D]: row b's
    softmax(q k^T * scale) v over its keys at positions key_ranges[b, 0]..key_ranges[b, 1] - 1 of its blocks
    block_table[b] (ids, padded) in kv_cache [2, num_blocks, block_size, Hkv, D]; the query heads of one KV head are
    consecutive (GQA). A row's result does not depend on the others."""
    return torch.ops.fasterllm_cpu.decode_attention(query, kv_cache, block_table, key_ranges, scale)


def rotary_store_runs(qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_cache: torch.Tensor) -> bool:
    """Whether a decode batch's RoPE and K/V store go to rotary_store: _takes, and full-width rotary tables."""
    return isinstance(rope, tuple) and rope[0].shape[-1] == qkv.shape[-1] and _takes(qkv, kv_cache)


def rotary_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, num_heads: int) -> None:
    """qkv [T, Hq + 2 Hkv, D]: its query and key heads rotated in place (cos, sin: this step's [T, 1, D] rows, as
    RotaryEmbedding.cos_sin_for gives them), then the first len(slot_mapping) tokens' keys and values written to their
    slots of kv_cache [2, num_blocks, block_size, Hkv, D]: what apply_rotary and store_kv do, to the bit."""
    torch.ops.fasterllm_cpu.rotary_store(qkv, cos, sin, kv_cache, slot_mapping.to(torch.long), num_heads)
