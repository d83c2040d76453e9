"""Fused variable-length attention for packed sequences (Triton): one program per (query block, sequence, head).

Each program reads its sequence's range from cu_seqlens, keeps its query block in registers and streams
that sequence's keys and values with an online softmax (flash attention), so neither a padded
[batch, max_len] layout nor the [len, len] score matrix is ever written to memory. The torch reference is
fasterllm.layers.varlen_attention.varlen_attention's SDPA path.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fasterllm.kernels.online_softmax import LOG2E, dot, online_softmax_update


@triton.jit
def _varlen_attention_kernel(qkv_ptr, out_ptr, cu_seqlens_ptr, scale_log2, stride_token, stride_part, stride_head,
                             stride_out_token, stride_out_head, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IEEE_DOT: tl.constexpr):
    query_block, seq, head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = tl.load(cu_seqlens_ptr + seq)
    seq_len = tl.load(cu_seqlens_ptr + seq + 1) - start
    if query_block * BLOCK_M < seq_len:
        rows = query_block * BLOCK_M + tl.arange(0, BLOCK_M)
        dims = tl.arange(0, BLOCK_D)
        dim_ok = dims < HEAD_DIM
        head_base = qkv_ptr + start * stride_token + head * stride_head
        q = tl.load(head_base + rows[:, None] * stride_token + dims[None, :],
                    mask=(rows[:, None] < seq_len) & dim_ok[None, :], other=0.0)
        row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        for key_start in range(0, seq_len, BLOCK_N):
            cols = key_start + tl.arange(0, BLOCK_N)
            kv_mask = (cols[:, None] < seq_len) & dim_ok[None, :]
            kv_offsets = cols[:, None] * stride_token + dims[None, :]
            k = tl.load(head_base + stride_part + kv_offsets, mask=kv_mask, other=0.0)
            v = tl.load(head_base + 2 * stride_part + kv_offsets, mask=kv_mask, other=0.0)
            scores = tl.where(cols[None, :] < seq_len, dot(q, tl.trans(k), IEEE_DOT) * scale_log2, float("-inf"))
            row_max, row_sum, acc = online_softmax_update(scores, v, row_max, row_sum, acc, IEEE_DOT)
        out = acc / row_sum[:, None]
        out_ptrs = out_ptr + (start + rows)[:, None] * stride_out_token + head * stride_out_head + dims[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=(rows[:, None] < seq_len) & dim_ok[None, :])


def varlen_attention_triton(qkv: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                            num_heads: int) -> torch.Tensor:
    """qkv: [total_tokens, 3 * hidden] (q, k, v side by side); cu_seqlens: [num_seqs + 1] int32 on qkv's device.

    Returns [total_tokens, hidden]: softmax(q k^T / sqrt(head_dim)) v within each sequence. max_seqlen need only
    bound the lengths (programs past a sequence's end return at once), so a CUDA graph can fix it; rows of qkv
    that belong to no sequence (a graph's padding) are left unwritten.
    """
    total, three_hidden = qkv.shape
    hidden = three_hidden // 3
    head_dim = hidden // num_heads
    out = torch.empty(total, hidden, dtype=qkv.dtype, device=qkv.device)
    block = 64 if max_seqlen > 32 else 16  # tl.dot needs at least 16 rows
    grid = (triton.cdiv(max_seqlen, block), cu_seqlens.numel() - 1, num_heads)
    _varlen_attention_kernel[grid](
        qkv, out, cu_seqlens, head_dim ** -0.5 * LOG2E, qkv.stride(0), hidden, head_dim, out.stride(0), head_dim,
        HEAD_DIM=head_dim, BLOCK_M=block, BLOCK_N=block, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        IEEE_DOT=qkv.dtype == torch.float32)
    return out
