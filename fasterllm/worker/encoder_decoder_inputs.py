"""The worker's part of encoder-decoder models: run the encoder for the requests whose decoder starts this step.

A request's encoder runs in the step that computes its decoder's first token (admission, or again after a
preemption by recompute freed its blocks): the encoder inputs of all such requests are packed into one pass
(padding-free, as the BERT path runs) and every decoder layer's cross K/V is stored in the request's cross blocks.
Forks (parallel samples) start past token 0 and read the blocks they share with their parent; a beam search's slots
all read its one cross table.
"""
from __future__ import annotations

import torch

from fasterllm.layers.varlen_attention import VarlenBatch
from fasterllm.worker.beam_search import SearchState
from fasterllm.worker.request_states import RequestState


def run_encoders(model: torch.nn.Module, encoder_token_ids: list[list[int]], cross_tables: list[list[int]],
                 kv_caches: torch.Tensor, block_size: int, device: torch.device) -> None:
    """One packed encoder pass over these encoder inputs; each one's cross K/V stored by its cross table."""
    lens = [len(ids) for ids in encoder_token_ids]
    positions = [p for length in lens for p in range(length)]
    slots = [table[p // block_size] * block_size + p % block_size
             for table, length in zip(cross_tables, lens) for p in range(length)]
    model.encode(torch.tensor([t for ids in encoder_token_ids for t in ids], device=device),
                 torch.tensor(positions, device=device), VarlenBatch.from_lengths(lens, device), kv_caches,
                 torch.tensor(slots, device=device))


def encode_starting(model: torch.nn.Module, starting: list[RequestState | SearchState], kv_caches: torch.Tensor,
                    block_size: int, device: torch.device) -> None:
    """The encoder for the scheduled requests and searches whose decoder chunk starts at token 0."""
    if starting:
        run_encoders(model, [state.encoder_token_ids for state in starting],
                     [state.cross_block_table for state in starting], kv_caches, block_size, device)

