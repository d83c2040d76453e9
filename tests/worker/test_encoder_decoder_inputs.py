"""The packed encoder inputs of the requests whose decoder starts in a step: each token's position in its own input
and the slot of its cross K/V in its own cross table."""
from __future__ import annotations

import numpy as np
import pytest

from fasterllm.worker.cross_encoder_graphs import startup_buckets
from fasterllm.worker.encoder_decoder_inputs import cross_slots
from fasterllm.worker.encoder_graphs import bucket
from fasterllm.worker.encoder_inputs import split_staged, stage_packed_inputs


def _slots(token_ids: list[list[int]], cross_tables: list[list[int]], block_size: int) -> list[int]:
    """The slots run_encoders computes: from the positions staged with the packed inputs."""
    total = sum(map(len, token_ids))
    positions = split_staged(stage_packed_inputs(token_ids, total, len(token_ids), pin=False), total)[1].numpy()
    return cross_slots(np.array(list(map(len, token_ids))), positions, cross_tables, block_size).tolist()


def test_slots_follow_each_cross_table_by_the_position_in_each_input():
    # block 4 then 2 for the first input, block 7 for the second, 1, 3, 0 for the third; 2 slots a block
    assert _slots([[5, 6, 7], [8], [9, 10, 11, 12, 13]], [[4, 2], [7], [1, 3, 0]], block_size=2) == \
        [8, 9, 4, 14, 2, 3, 6, 7, 0]


def test_a_cross_table_too_short_for_its_input_is_refused():
    with pytest.raises(ValueError, match="encoder input 0 has 3 tokens but its cross table only 1 blocks of 2"):
        _slots([[1, 2, 3], [4]], [[5], [7, 8]], block_size=2)


def test_every_batch_a_step_can_hold_has_its_encoder_graph_captured_at_start_up():
    keys = set(startup_buckets(max_tokens=8192, max_seqs=256))
    for num_tokens in range(1, 8193, 7):
        for num_seqs in {1, 8, 9, 64, 129, 200, 256}:
            if num_seqs <= num_tokens:
                assert bucket(num_tokens, num_seqs) in keys, (num_tokens, num_seqs)
    assert max(t for t, _ in keys) == 8192 and len(startup_buckets(100, 4)) == 1  # one bucket holds a small engine
