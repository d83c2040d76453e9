"""A decode batch moved on by one token (positions and lengths on the device, only the changed tables sent, slots
looked up on the device) stages what staging the next step from scratch stages (on a GPU), and only a batch of the
same rows, each one token longer, is moved on."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fasterllm.worker.input_buffers import InputBuffers, continues_decode

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
BLOCK = 4


def staged(batch, tables: list[list[int]]) -> dict:
    kernel = batch.meta.kernel
    return {"input_ids": batch.input_ids.tolist(), "positions": batch.meta.positions.tolist(),
            "slot_mapping": batch.meta.slot_mapping.tolist(), "seq_lens": kernel.seq_lens.tolist(),
            "query_start": kernel.query_start_loc.tolist(), "logits_rows": batch.logits_indices.tolist(),
            "tables": [kernel.block_tables[row, :len(table)].tolist() for row, table in enumerate(tables)]}


@GPU
def test_a_decode_batch_moved_on_stages_what_a_full_staging_does():
    device = torch.device("cuda")
    moved, fresh = (InputBuffers(64, 8, 8, BLOCK, device) for _ in range(2))
    seq_lens, tables = [5, 8, 3], [[1, 2], [3, 4], [5]]
    identity = (("a", "b", "c"), 4)
    moved.stage([7, 8, 9], [1, 1, 1], seq_lens, tables, [0, 1, 2], padded_seqs=4, identity=identity)
    # a step on: the second sequence's 9th token opens a new block, the third's write block was copied on write;
    # then a step whose inputs are the samples of the step before, on the device
    for step_tables, changed, on_device in (([[1, 2], [3, 4, 6], [10]], [1, 2], False),
                                            ([[1, 2], [3, 4, 6], [10]], [], True)):
        seq_lens = [n + 1 for n in seq_lens]
        token_ids = [n * 10 for n in seq_lens]
        assert moved.continues(identity, seq_lens)
        samples = torch.tensor(token_ids, device=device) if on_device else None
        got = moved.advance_decode([0] * 3 if on_device else token_ids, [(row, step_tables[row]) for row in changed],
                                   samples)
        want = fresh.stage(token_ids, [1, 1, 1], seq_lens, step_tables, [0, 1, 2], padded_seqs=4)
        assert staged(got, step_tables) == staged(want, step_tables)


def test_only_the_same_rows_each_one_token_longer_continue_the_step_before():
    rows = ((("a", "b"), (), ()), 8)
    last = (rows, np.array([6, 7]))
    assert continues_decode(last, rows, np.array([7, 8]))
    assert not continues_decode(None, rows, np.array([7, 8]))
    assert not continues_decode(last, ((("a", "c"), (), ()), 8), np.array([7, 8]))  # another request in a row
    assert not continues_decode(last, ((("a", "b"), (), ()), 16), np.array([7, 8]))  # another graph
    assert not continues_decode(last, rows, np.array([7, 1]))  # "b" ended and its id came back, one-token prompt
    assert not continues_decode(last, rows, np.array([6, 7]))  # the step again, after its launch failed
