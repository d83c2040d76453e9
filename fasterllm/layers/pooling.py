"""Pool the packed token states of each sequence into one vector (sentence-transformers' pooling modes)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fasterllm.config import PoolingConfig

def pool(hidden: torch.Tensor, cu_seqlens: torch.Tensor, config: PoolingConfig) -> torch.Tensor:
    """hidden: [total_tokens, hidden] packed; cu_seqlens: [num_seqs + 1] -> [num_seqs, hidden] in fp32."""
    starts, ends = cu_seqlens[:-1].long(), cu_seqlens[1:].long()
    lengths = ends - starts
    if config.mode == "cls":
        pooled = hidden[starts].float()
    elif config.mode == "last":
        pooled = hidden[ends - 1].float()
    elif config.mode == "max":
        pooled = torch.segment_reduce(hidden.float(), "max", lengths=lengths)
    else:
        # output_size: without it repeat_interleave waits for the device to learn how many rows it makes
        seq_index = torch.repeat_interleave(torch.arange(len(lengths), device=hidden.device), lengths,
                                            output_size=hidden.shape[0])
        sums = hidden.new_zeros(len(lengths), hidden.shape[1], dtype=torch.float32).index_add_(0, seq_index, hidden.float())
        divisor = lengths.float() if config.mode == "mean" else lengths.float().sqrt()
        pooled = sums / divisor.unsqueeze(1)
    return F.normalize(pooled, dim=-1) if config.normalize else pooled
