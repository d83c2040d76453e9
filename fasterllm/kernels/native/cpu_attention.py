"""One sequence's decode-step attention over its paged KV cache in one C++ call (cpu/decode_attention.cpp, built by
cpu_extension.py), for single-stream decoding on the CPU. The torch path (layers/attention.py) gathers the
sequence's blocks, reshapes them and calls SDPA: about 30 us a layer for SmolLM2's three KV heads and a few hundred
keys, nearly all of it the ops' fixed costs; the C++ call reads the blocks in place (benchmarks/RESULTS.md).

bf16 models only, as cpu_rms_norm.py: its sums run in another order than SDPA's, which fp32 runs would see against
transformers' own; in bf16 the outputs agree up to a bf16 rounding (tests/layers/test_cpu_decode_attention.py)."""
from __future__ import annotations

import torch

from fasterllm.kernels.native import cpu_extension

_NO_IDS = torch.empty(0, dtype=torch.long)


def runs(query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether layers/attention.py hands this decode to decode_attention (bf16 query and cache, the extension
    built)."""
    return query.dtype == torch.bfloat16 and kv_cache.dtype == query.dtype and cpu_extension.available()


def decode_attention(query: torch.Tensor, kv_cache: torch.Tensor, blocks: torch.Tensor | slice, keys: slice,
                     scale: float) -> torch.Tensor:
    """query [Hq, D] of one sequence's new token -> [Hq, D]: softmax(q k^T * scale) v over its keys at positions
    keys.start..keys.stop - 1 of its blocks (a tensor of block ids, or a slice of consecutive ones) in kv_cache
    [2, num_blocks, block_size, Hkv, D]. The query heads of one KV head are consecutive (GQA)."""
    if isinstance(blocks, slice):
        block_ids, first_block = _NO_IDS, blocks.start
    else:
        block_ids, first_block = blocks.to(torch.long), 0
    return torch.ops.fasterllm_cpu.decode_attention(query.contiguous(), kv_cache, block_ids, first_block, keys.start,
                                                    keys.stop, scale)
