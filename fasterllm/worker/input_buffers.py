"""A step's batch inputs on a GPU: built in pinned host buffers, copied to fixed device buffers.

The device buffers never move, so a CUDA graph captured over slices of them replays with whatever a
later step copied in; the copies are non-blocking (pinned memory), so staging never waits for the
GPU. Two sets of pinned buffers take turns: with asynchronous scheduling a step is staged while the
one before it may not have copied its inputs yet, but the step before that had its sampled ids read,
which waited for every copy it queued.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from fasterllm.kernels.decode_advance import advance_decode_inputs
from fasterllm.layers.attention import AttentionMetadata, KernelInputs


@dataclass
class StagedBatch:
    input_ids: torch.Tensor  # [T] (padded to the graph's batch size when one replays)
    logits_indices: torch.Tensor
    meta: AttentionMetadata


class InputBuffers:
    def __init__(self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, block_size: int,
                 device: torch.device, max_cross_blocks_per_seq: int = 0):
        """max_cross_blocks_per_seq: an encoder-decoder model's cross tables' width (0: a decoder-only model)."""
        self.block_size = block_size
        self.max_tokens, self.max_seqs = max_tokens, max_seqs
        max_rows = 2 * max_tokens + max_seqs  # logits rows: samples (best_of at a first token) + prompt scoring

        def pair(*shape: int, dtype: torch.dtype) -> tuple[list[torch.Tensor], torch.Tensor]:
            hosts = [torch.zeros(shape, dtype=dtype, pin_memory=True) for _ in range(2)]
            return hosts, torch.zeros(shape, dtype=dtype, device=device)

        self.input_ids = pair(max_tokens, dtype=torch.long)
        self.positions = pair(max_tokens, dtype=torch.long)
        self.slot_mapping = pair(max_tokens, dtype=torch.long)
        self.logits_indices = pair(max_rows, dtype=torch.long)
        self.block_tables = pair(max_seqs, max_blocks_per_seq, dtype=torch.int32)
        self.seq_lens = pair(max_seqs, dtype=torch.int32)
        self.query_start_loc = pair(max_seqs + 1, dtype=torch.int32)
        if max_cross_blocks_per_seq:
            self.cross_tables = pair(max_seqs, max_cross_blocks_per_seq, dtype=torch.int32)
            self.encoder_lens = pair(max_seqs, dtype=torch.int32)
        self.turn = 0  # which pinned set this step writes
        # the last graph decode batch staged with its rows' identity: (it, seqs, padded rows, identity, lengths)
        self.decode: tuple[StagedBatch, int, int, tuple, np.ndarray] | None = None

    def stage(self, token_ids: list[int], query_lens: list[int], seq_lens: list[int],
              block_tables: list[list[int]], logits_rows: list[int], padded_seqs: int | None = None,
              cross: tuple[list[int], list[list[int]]] | None = None,
              padded_tokens: int | None = None, identity: tuple | None = None) -> StagedBatch:
        """Fill the buffers for one step. padded_seqs: a decode batch padded to a captured graph's size;
        the padding rows own no query rows, store nothing (slot -1) and read no keys (length 0). padded_tokens: any
        step's tokens padded to a piecewise graph's size (the padding tokens belong to no sequence and store
        nothing). cross: an encoder-decoder model's (encoder lengths, cross tables), read by its cross-attention
        (meta.cross). identity: what each row of a decode batch is (the caller's key, with the graph's size): the next
        step of the same rows may be moved on (advance_decode)."""
        num_tokens, num_seqs = len(token_ids), len(query_lens)
        rows = padded_seqs or num_seqs
        tokens_out = padded_seqs or padded_tokens or num_tokens
        query = np.asarray(query_lens, dtype=np.int64)
        total = np.asarray(seq_lens, dtype=np.int64)
        starts = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(query, out=starts[1:])
        positions = np.arange(num_tokens) - np.repeat(starts[:-1] - (total - query), query)
        self.turn ^= 1
        turn = self.turn
        device_tables = self._tables(self.block_tables, block_tables, rows)
        tables = self.block_tables[0][turn].numpy()
        seq_index = np.repeat(np.arange(num_seqs), query)
        slots = tables[seq_index, positions // self.block_size].astype(np.int64) * self.block_size
        slots += positions % self.block_size

        fill = self._fill
        input_ids = fill(self.input_ids, token_ids, tokens_out)
        positions_t = fill(self.positions, positions, tokens_out)
        slot_mapping = fill(self.slot_mapping, slots, tokens_out, pad=-1)
        if len(logits_rows) <= self.logits_indices[1].numel():
            logits_indices = fill(self.logits_indices, logits_rows, len(logits_rows) if padded_seqs is None else rows)
        else:  # many samples per prompt (large best_of) in an eager step: a tensor of its own
            logits_indices = host_to_device(logits_rows, torch.long, self.input_ids[1].device)
        seq_lens_t = fill(self.seq_lens, total, rows)
        query_start = fill(self.query_start_loc, starts, rows + 1, pad=num_tokens)
        max_query_len = int(query.max())
        kernel = KernelInputs(device_tables, seq_lens_t, query_start, max_query_len)
        meta = AttentionMetadata(positions_t, slot_mapping, num_tokens, [], None, kernel)
        if cross is not None:
            encoder_lens, cross_tables = cross
            cross_kernel = KernelInputs(self._tables(self.cross_tables, cross_tables, rows),
                                        fill(self.encoder_lens, encoder_lens, rows), query_start, max_query_len)
            meta.cross = AttentionMetadata(positions_t, slot_mapping, num_tokens, [], None, cross_kernel)
        batch = StagedBatch(input_ids, logits_indices, meta)
        decode = padded_seqs is not None and identity is not None
        self.decode = (batch, num_seqs, rows, identity, total) if decode else None
        return batch

    def continues(self, identity: tuple, seq_lens: list[int]) -> bool:
        """Whether a decode batch is the one staged last, one token on (advance_decode may stage it)."""
        last = self.decode
        return last is not None and continues_decode((last[3], last[4]), identity, np.asarray(seq_lens))

    def advance_decode(self, token_ids: list[int], changed_tables: list[tuple[int, list[int]]],
                       samples: torch.Tensor | None = None) -> StagedBatch:
        """The decode batch staged last, one token further: the same sequences in the same rows, each one position
        on. The rows in changed_tables ((row, its whole block table): a block added or copied on write) are sent,
        then one launch moves positions and lengths on and looks the slots up (kernels/decode_advance.py). The
        token ids come from the host, or where every row's input is the previous step's sample, from samples (its
        first rows on the device)."""
        batch, num_seqs, rows, identity, lens = self.decode
        self.decode = (batch, num_seqs, rows, identity, lens + 1)
        self.turn ^= 1
        if samples is None:
            self._fill(self.input_ids, token_ids, rows)
        tables = self.block_tables[1]
        if changed_tables:
            width = max(len(table) for _, table in changed_tables)
            packed = host_to_device([[row] + table + [0] * (width - len(table)) for row, table in changed_tables],
                                    torch.int32, tables.device)
            tables[packed[:, 0].long(), :width] = packed[:, 1:]
        advance_decode_inputs(self.positions[1], self.seq_lens[1], self.slot_mapping[1], tables, self.block_size,
                              num_seqs, *(() if samples is None else (self.input_ids[1], samples)))
        return batch

    def compile_advance(self) -> None:
        """Compile advance_decode's kernel, with and without samples, on scratch rows shaped as the buffers' (a
        serving step would otherwise wait for the compiler)."""
        def scratch(buffers: tuple[list[torch.Tensor], torch.Tensor]) -> torch.Tensor:
            return buffers[1][:1].clone()

        for with_samples in (False, True):
            ids = (scratch(self.input_ids), torch.zeros_like(scratch(self.input_ids))) if with_samples else ()
            advance_decode_inputs(scratch(self.positions), scratch(self.seq_lens), scratch(self.slot_mapping),
                                  scratch(self.block_tables), self.block_size, 1, *ids)

    def _fill(self, buffers: tuple[list[torch.Tensor], torch.Tensor], values, count: int, pad: int = 0) -> torch.Tensor:
        """values, padded to count with pad, into this turn's host buffer and on to the device buffer."""
        host, device = buffers[0][self.turn], buffers[1]
        array = host.numpy()
        array[:len(values)] = values
        array[len(values):count] = pad
        device[:count].copy_(host[:count], non_blocking=True)
        return device[:count]

    def _tables(self, buffers: tuple[list[torch.Tensor], torch.Tensor], tables: list[list[int]],
                rows: int) -> torch.Tensor:
        """The step's block tables in the buffers (only the columns they use are copied); the first `rows` rows."""
        host, device = buffers[0][self.turn], buffers[1]
        # one numpy scatter of all the tables' entries: a row-by-row assignment costs ~1 us a sequence
        lengths = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
        entries = np.fromiter(chain.from_iterable(tables), dtype=np.int32, count=int(lengths.sum()))
        starts = np.cumsum(lengths) - lengths
        host.numpy()[np.repeat(np.arange(len(tables)), lengths),
                     np.arange(len(entries)) - np.repeat(starts, lengths)] = entries
        width = int(lengths.max())
        device[:len(tables), :width].copy_(host[:len(tables), :width], non_blocking=True)
        return device[:rows]


_NUMPY_DTYPES = {torch.long: np.int64, torch.int32: np.int32, torch.float32: np.float32, torch.bool: np.bool_}


def continues_decode(last: tuple[tuple, np.ndarray] | None, identity: tuple, lens: np.ndarray) -> bool:
    """Whether a decode batch is the graph step before it one token on: the same rows (what each row is, the graph's
    size) and each row's length one more (not a finished request's id taken again by a one-token first step, nor a
    step scheduled again after its launch failed). last: that step's identity and lengths."""
    return last is not None and last[0] == identity and np.array_equal(lens, last[1] + 1)


def host_to_device(values: list | np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small per-step tensor: through pinned memory on a GPU, so the copy does not wait for it. On the CPU a numpy
    array of the same dtype comes back as a tensor over the caller's memory (not a copy)."""
    tensor = host_tensor(values, dtype, pin=device.type == "cuda")
    return tensor.to(device, non_blocking=True) if device.type == "cuda" else tensor


def host_tensor(values: list | np.ndarray, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """values (lists, or a numpy array) as a host tensor, pinned (a copy) if pin; unpinned, a numpy array of the same
    dtype is not copied. Lists go through numpy, which converts them about 3x faster than torch.tensor (1,792 ints: 73
    against 225 us)."""
    tensor = (torch.from_numpy(np.asarray(values, dtype=_NUMPY_DTYPES[dtype])) if dtype in _NUMPY_DTYPES
              else torch.tensor(values, dtype=dtype))
    return tensor.pin_memory() if pin else tensor
