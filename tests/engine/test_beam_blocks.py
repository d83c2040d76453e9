"""A search's slot tables over the block pool: full blocks shared by the slots that descend from them, each slot's
partly filled last block its own (copied from its parent's when it continues another slot), blocks no slot lists
given back at the next block boundary, and every block back in the pool after free()."""
from __future__ import annotations

from fasterllm.engine.beam_blocks import SearchBlocks
from fasterllm.engine.kv_cache_manager import KVCacheManager

SIZE = 4


def held_by_slots(blocks: SearchBlocks) -> set[int]:
    return set().union(*blocks.tables)


def test_prompt_then_selections_mid_block_and_at_the_boundary():
    kv = KVCacheManager(32, SIZE, enable_prefix_caching=False)
    blocks = SearchBlocks(kv, 3)
    # a 6-token prompt in two chunks; the second ends it and selects: the other slots get their own last block
    assert blocks.allocate(0, 4, 1, selects=False)
    assert blocks.allocate(4, 2, 1, selects=True)
    prompt = list(blocks.tables[0])
    assert len(prompt) == 2 and kv.num_free_blocks == 32 - 4
    blocks.reorder([0, 0, 0], 6)  # the first selection: every slot continues the prompt
    assert kv.take_pending_copies() == [(prompt[1], blocks.tables[1][1]), (prompt[1], blocks.tables[2][1])]
    assert [t[0] for t in blocks.tables] == [prompt[0]] * 3  # the full block is shared, held once
    assert kv.ref_counts[prompt[0]] == 1
    assert len({t[1] for t in blocks.tables}) == 3
    changes = dict((slot, (start, tail)) for slot, start, tail in blocks.take_changes())
    assert changes[0] == (0, prompt) and changes[1][0] == 0 and changes[2][0] == 0
    assert blocks.take_changes() == []

    assert blocks.allocate(6, 1, 3, selects=True)  # position 6 fits the last blocks: nothing new
    assert kv.num_free_blocks == 32 - 4
    last = [t[1] for t in blocks.tables]
    blocks.reorder([0, 1, 0], 7)  # slot 2's beam was not chosen: it continues slot 0's, copying its last block
    assert kv.take_pending_copies() == [(last[0], last[2])]
    assert blocks.tables[2] == [prompt[0], last[2]]
    assert [slot for slot, _, _ in blocks.take_changes()] == [2]

    assert blocks.allocate(7, 1, 3, selects=True)  # position 7 fills the last blocks
    blocks.reorder([1, 1, 2], 8)  # at the boundary: slot 0 lists slot 1's full blocks, nothing is copied
    assert kv.take_pending_copies() == []
    assert blocks.tables[0] == blocks.tables[1] == [prompt[0], last[1]]
    assert last[0] in blocks.held and last[0] not in held_by_slots(blocks)  # kept until slots next grow
    assert blocks.allocate(8, 1, 3, selects=True)  # a new last block each; the unlisted full block goes back
    assert blocks.held == held_by_slots(blocks) and last[0] not in blocks.held
    assert kv.num_free_blocks == 32 - len(blocks.held) == 32 - 6
    blocks.free()
    assert kv.num_free_blocks == 32 and not blocks.held


def test_a_resumed_search_spreads_its_slots_from_the_recomputed_prompt():
    kv = KVCacheManager(16, SIZE, enable_prefix_caching=False)
    blocks = SearchBlocks(kv, 2)
    assert blocks.allocate(0, 5, 1, selects=False)  # the prompt again, computed by slot 0 alone
    assert not blocks.allocate(5, 40, 2, selects=True)  # short: nothing is taken
    assert kv.num_free_blocks == 14 and not blocks.spread
    assert blocks.allocate(5, 3, 2, selects=True)  # the slots' own tokens: slot 1 copies the prompt's last block
    assert kv.take_pending_copies() == [(blocks.tables[0][1], blocks.tables[1][1])]
    assert blocks.tables[0][0] == blocks.tables[1][0] and len(blocks.tables[0]) == len(blocks.tables[1]) == 2
    assert blocks.allocate(8, 1, 2, selects=True)
    assert [len(t) for t in blocks.tables] == [3, 3] and kv.num_free_blocks == 16 - 5
    blocks.free()
    assert kv.num_free_blocks == 16
    assert sorted(slot for slot, _, _ in blocks.take_changes()) == [0, 1]  # the worker drops the old tables
