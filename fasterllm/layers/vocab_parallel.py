"""The token embedding with its vocabulary split over tensor-parallel ranks (one rank: a plain lookup).

Each rank keeps ceil(vocab / size) rows; a token outside a rank's rows looks up zeros there, and the sum over ranks
is the token's row. The output head reads the same rows (tied or not) and its logits are gathered over ranks.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fasterllm.distributed.tensor_parallel import TensorParallel


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.first_row, self.num_rows = tp.vocab_rows(vocab_size)
        self.weight = nn.Parameter(torch.empty(self.num_rows, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.partial_rows(input_ids))

    def partial_rows(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The rows this rank holds, zeros for the others: their sum over ranks is forward's. A model sums them in
        its first norm's launch (TensorParallel.all_reduce_add_norm). Each token's row is on one rank, so the sum
        is exact, and a scale applied to the partial rows before it is the scale of the whole rows."""
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.first_row
        outside = (local < 0) | (local >= self.num_rows)
        hidden = F.embedding(local.masked_fill(outside, 0), self.weight)
        return hidden.masked_fill_(outside[:, None], 0)
