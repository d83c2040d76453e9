"""The packed encoder inputs of the requests whose decoder starts in a step: each token's position in its own input
and the slot of its cross K/V in its own cross table."""
from __future__ import annotations

from fasterllm.worker.encoder_decoder_inputs import packed_encoder_inputs


def test_positions_restart_per_input_and_slots_follow_each_cross_table():
    tokens, positions, slots = packed_encoder_inputs([[5, 6, 7], [8], [9, 10, 11, 12, 13]], [[4, 2], [7], [1, 3, 0]],
                                                     block_size=2)
    assert tokens.tolist() == [5, 6, 7, 8, 9, 10, 11, 12, 13]
    assert positions.tolist() == [0, 1, 2, 0, 0, 1, 2, 3, 4]
    # block 4 then 2 for the first input, block 7 for the second, 1, 3, 0 for the third; 2 slots a block
    assert slots.tolist() == [8, 9, 4, 14, 2, 3, 6, 7, 0]
