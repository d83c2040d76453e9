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
from fasterllm.worker.input_buffers import host_to_device
from fasterllm.worker.request_states import RequestState


def run_encoders(model: torch.nn.Module, encoder_token_ids: list[list[int]], cross_tables: list[list[int]],
                 kv_caches: torch.Tensor, block_size: int, device: torch.device,
                 graphs: CrossEncoderGraphs | None = None) -> None:
    """One packed encoder pass over these encoder inputs, each one's cross K/V stored by its cross table: replayed
    from graphs where they hold the batch."""
    tokens, positions, slots = packed_encoder_inputs(encoder_token_ids, cross_tables, block_size)
    if graphs is not None and graphs.fits(len(tokens)):
        graphs.run(encoder_token_ids, slots)
        return
    model.encode(host_to_device(tokens, torch.long, device), host_to_device(positions, torch.long, device),
                 VarlenBatch.from_lengths([len(ids) for ids in encoder_token_ids], device), kv_caches,
                 host_to_device(slots, torch.long, device))


def packed_encoder_inputs(encoder_token_ids: list[list[int]], cross_tables: list[list[int]],
                          block_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The packed token ids, each token's position in its input, and the cache slot of its cross K/V, in numpy:
    a batch of 64 x 128 tokens built as Python lists took several milliseconds of the host."""
    lens = np.fromiter(map(len, encoder_token_ids), dtype=np.int64, count=len(encoder_token_ids))
    total = int(lens.sum())
    tokens = np.fromiter(chain.from_iterable(encoder_token_ids), dtype=np.int64, count=total)
    positions = np.arange(total) - np.repeat(np.cumsum(lens) - lens, lens)
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
    return tokens, positions, slots + positions % block_size


def encode_starting(model: torch.nn.Module, starting: list[RequestState | SearchState], kv_caches: torch.Tensor,
                    block_size: int, device: torch.device, graphs: CrossEncoderGraphs | None = None) -> None:
    """The encoder for the scheduled requests and searches whose decoder chunk starts at token 0."""
    if starting:
        run_encoders(model, [state.encoder_token_ids for state in starting],
                     [state.cross_block_table for state in starting], kv_caches, block_size, device, graphs)
