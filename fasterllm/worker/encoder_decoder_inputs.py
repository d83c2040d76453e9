"""The worker's part of encoder-decoder models: run the encoder for the requests whose decoder starts this step.

A request's encoder runs in the step that computes its decoder's first token (admission, or again after a
preemption by recompute freed its blocks): the encoder inputs of all such requests are packed into one pass
(padding-free, as the BERT path runs) and every decoder layer's cross K/V is stored in the request's cross blocks.
Forks (parallel samples) start past token 0 and read the blocks they share with their parent; a beam search's slots
all read its one cross table.
"""
from __future__ import annotations

from itertools import chain

import numpy as np
import torch

from fasterllm.layers.varlen_attention import VarlenBatch
from fasterllm.worker.beam_search import SearchState
from fasterllm.worker.cross_encoder_graphs import CrossEncoderGraphs
from fasterllm.worker.encoder_graphs import bucket, fits_a_bucket
from fasterllm.worker.encoder_inputs import split_staged, stage_packed_inputs
from fasterllm.worker.input_buffers import host_to_device
from fasterllm.worker.request_states import RequestState


def run_encoders(model: torch.nn.Module, encoder_token_ids: list[list[int]], cross_tables: list[list[int]],
                 kv_caches: torch.Tensor, block_size: int, device: torch.device,
                 graphs: CrossEncoderGraphs | None = None) -> None:
    """One packed encoder pass over these encoder inputs, each one's cross K/V stored by its cross table: replayed
    from graphs where they hold the batch."""
    lens = np.fromiter(map(len, encoder_token_ids), dtype=np.int64, count=len(encoder_token_ids))
    total = int(lens.sum())
    replay = graphs is not None and fits_a_bucket(total)
    capacity = bucket(total, len(encoder_token_ids)) if replay else (total, len(encoder_token_ids))
    staged = stage_packed_inputs(encoder_token_ids, *capacity, pin=device.type == "cuda")
    slots = cross_slots(lens, split_staged(staged, capacity[0])[1][:total].numpy(), cross_tables, block_size)
    if replay:
        graphs.run(capacity, staged, slots)
        return
    token_ids, positions, cu_seqlens = split_staged(staged.to(device, non_blocking=True), total)
    model.encode(token_ids, positions, VarlenBatch.from_lengths(lens.tolist(), device, cu_seqlens),
                 kv_caches, host_to_device(slots, torch.long, device))


def cross_slots(lens: np.ndarray, positions: np.ndarray, cross_tables: list[list[int]], block_size: int
                ) -> np.ndarray:
    """The cache slot of each packed token's cross K/V, from the inputs' lengths and each token's position in its
    own input, in numpy: a batch of 64 x 128 tokens done in Python lists took several milliseconds of the host."""
    table_lens = np.fromiter(map(len, cross_tables), dtype=np.int64, count=len(cross_tables))
    if (table_lens * block_size < lens).any():  # its K/V would land in another request's blocks
        row = int(np.argmax(table_lens * block_size < lens))
        raise ValueError(f"encoder input {row} has {lens[row]} tokens but its cross table only {table_lens[row]} "
                         f"blocks of {block_size}: the scheduler must allocate its cross blocks first")
    tables = np.zeros((len(cross_tables), int(table_lens.max())), dtype=np.int64)
    tables[np.repeat(np.arange(len(cross_tables)), table_lens),
           np.arange(int(table_lens.sum())) - np.repeat(np.cumsum(table_lens) - table_lens, table_lens)] = \
        np.fromiter(chain.from_iterable(cross_tables), dtype=np.int64, count=int(table_lens.sum()))
    slots = tables[np.repeat(np.arange(len(lens)), lens), positions // block_size] * block_size
    return slots + positions % block_size


def encode_starting(model: torch.nn.Module, starting: list[RequestState | SearchState], kv_caches: torch.Tensor,
                    block_size: int, device: torch.device, graphs: CrossEncoderGraphs | None = None) -> None:
    """The encoder for the scheduled requests and searches whose decoder chunk starts at token 0."""
    if starting:
        run_encoders(model, [state.encoder_token_ids for state in starting],
                     [state.cross_block_table for state in starting], kv_caches, block_size, device, graphs)
