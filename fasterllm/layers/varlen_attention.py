"""Bidirectional attention over packed variable-length sequences: no [batch, max_len] padding anywhere.

Tokens of all sequences sit in one [total_tokens, ...] tensor; cu_seqlens[i]:cu_seqlens[i + 1] is
sequence i. Each token attends only within its own sequence. Neighbouring sequences of the same length
form a run whose tokens are a [num_seqs, seq_len, ...] view of the packed tensor (no copy), so a
length-sorted batch needs one SDPA call per distinct length, and never computes a padded position.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class SequenceRun:
    start: int  # first token of the run in the packed tensor
    num_seqs: int
    seq_len: int


@dataclass
class VarlenBatch:
    """Where each sequence of a packed batch starts and ends (the prefix sums of its lengths)."""

    cu_seqlens: torch.Tensor  # [num_seqs + 1] int32 on the model's device, for kernels and pooling
    max_seqlen: int  # no sequence is longer (the GPU kernel's grid covers this many rows of each)
    runs: list[SequenceRun]  # for the torch path; a CUDA graph's batch, whose lengths change per replay, has none

    @classmethod
    def from_lengths(cls, seq_lens: list[int], device: torch.device, cu_seqlens: torch.Tensor | None = None
                     ) -> VarlenBatch:
        """cu_seqlens: these lengths' prefix sums already on the device (staged with the batch's other inputs
        in one copy); made here when not given."""
        if not seq_lens or min(seq_lens) < 1:
            raise ValueError(f"sequence lengths {seq_lens[:8]} must be a non-empty list of positive lengths")
        cu = [0]
        runs: list[SequenceRun] = []
        for length in seq_lens:
            if runs and runs[-1].seq_len == length:
                last = runs[-1]
                runs[-1] = SequenceRun(last.start, last.num_seqs + 1, length)
            else:
                runs.append(SequenceRun(cu[-1], 1, length))
            cu.append(cu[-1] + length)
        if cu_seqlens is None:
            cu_seqlens = torch.tensor(cu, dtype=torch.int32, device=device)
        return cls(cu_seqlens, max(seq_lens), runs)


def varlen_attention(qkv: torch.Tensor, batch: VarlenBatch, num_heads: int, scale: float | None = None,
                     bias: Callable[[int], torch.Tensor] | None = None) -> torch.Tensor:
    """qkv: [total_tokens, 3 * hidden] (q, k, v side by side) -> attention output [total_tokens, hidden].

    On a GPU one fused Triton kernel covers every sequence and head; elsewhere SDPA runs per run of lengths, as it
    does everywhere for a model with a scale of its own or an additive bias: bias(L) -> [heads, L, L] for sequences
    of length L (T5's relative positions).
    """
    if qkv.is_cuda and scale is None and bias is None:
        from fasterllm.kernels.varlen_attention import varlen_attention_triton

        return varlen_attention_triton(qkv, batch.cu_seqlens, batch.max_seqlen, num_heads)
    return varlen_attention_sdpa(qkv, batch, num_heads, scale, bias)


def varlen_attention_sdpa(qkv: torch.Tensor, batch: VarlenBatch, num_heads: int, scale: float | None = None,
                          bias: Callable[[int], torch.Tensor] | None = None) -> torch.Tensor:
    """The torch path (and the Triton kernel's reference): one SDPA call per run of equal lengths."""
    total, three_hidden = qkv.shape
    head_dim = three_hidden // (3 * num_heads)
    out = torch.empty(total, three_hidden // 3, dtype=qkv.dtype, device=qkv.device)
    for run in batch.runs:
        end = run.start + run.num_seqs * run.seq_len
        # [n, L, 3, heads, d] -> three [n, heads, L, d] strided views
        q, k, v = qkv[run.start:end].view(run.num_seqs, run.seq_len, 3, num_heads, head_dim).permute(2, 0, 3, 1, 4)
        mask = None if bias is None else bias(run.seq_len)[None]
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        out[run.start:end].view(run.num_seqs, run.seq_len, num_heads, head_dim).copy_(attended.transpose(1, 2))
    return out

