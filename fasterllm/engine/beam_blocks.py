"""A beam search's KV blocks: beam_width slot tables over blocks of the pool, reordered after each selection.

All beams of a search have the same length, so every slot needs a new block at the same step, whichever parents were
chosen. Each slot's last block is its own (private) while partly filled; its full blocks may be shared with other
slots. A selection reorders the tables by parent: a slot continuing another slot's beam takes that slot's full
blocks by reference and copies its partly filled last block into its own last block (the slot's previous beam was
not chosen, so that block is free to overwrite); a parent's first continuation stays in its slot and copies
nothing. At a block boundary (the parents' last blocks are full) nothing is copied at all. A lookahead step
(asynchronous scheduling) takes each slot's block for the next position before the selection in flight is read and
makes the reorder and its copies on the device (worker/beam_follow.py); the selection then reorders these tables the
same way without queueing copies.

The search holds one reference to each block it uses, however many slots list it. Full blocks that no slot lists any
more are given back when slots next grow (at the next block boundary): between boundaries no full block is made,
so what the search holds never exceeds what its slots listed at the last boundary plus one block per slot. This
keeps the per-step host work to a list per moved slot instead of reference counts per block per slot.
"""
from __future__ import annotations

from fasterllm.engine.kv_cache_manager import KVCacheManager


class SearchBlocks:
    def __init__(self, kv_cache: KVCacheManager, width: int):
        self.kv_cache, self.width = kv_cache, width
        self.tables: list[list[int]] = [[] for _ in range(width)]
        self.held: set[int] = set()  # every block the search holds a reference to
        self.spread = False  # every slot has its own table (after the first selection, or a resumed prompt)
        self.changed_from: dict[int, int] = {}  # slot -> first table index the worker has not been sent

    @property
    def num_blocks(self) -> int:
        return len(self.held)

    def allocate(self, num_computed: int, num_new: int, num_slots: int, selects: bool, reserve: int = 0) -> bool:
        """Grow the computing slots' tables to hold num_new more tokens each, keeping `reserve` blocks free; False,
        taking nothing, when the pool is short. Slot 0 computes the prompt alone; the chunk that ends it and selects
        also gives every other slot the block its copy of slot 0's partly filled last block will go to. A resumed
        search's slots spread from the recomputed prompt when they start computing their own tokens."""
        kv, size = self.kv_cache, self.kv_cache.block_size
        end = num_computed + num_new
        if num_slots == 1:
            grow = kv.blocks_for_tokens(end) - len(self.tables[0])
            private = self.width - 1 if selects and end % size else 0
            if grow + private + reserve > kv.num_free_blocks:
                return False
            self._append(0, grow)
            for slot in range(1, private + 1):
                self._append(slot, 1)
            return True
        if not self.spread:
            private = self.width - 1 if num_computed % size else 0
            grow = kv.blocks_for_tokens(end) - kv.blocks_for_tokens(num_computed)
            if private + grow * self.width + reserve > kv.num_free_blocks:
                return False
            for slot in range(1, private + 1):
                self._append(slot, 1)
            self.reorder([0] * self.width, num_computed)
        else:
            grow = kv.blocks_for_tokens(end) - len(self.tables[0])
            if grow > 0:
                self._give_back_unlisted()
            if grow * self.width + reserve > kv.num_free_blocks:
                return False
        for slot in range(self.width):
            self._append(slot, grow)
        return True

    def reorder(self, parents: list[int], num_computed: int, copied: bool = False) -> None:
        """Slot j continues slot parents[j]'s beam (a parent's first continuation is in its own slot); every slot
        has KV for num_computed tokens. Queues the copies of partly filled last blocks in the cache manager, unless
        `copied`: a lookahead step made them on the device already (worker/beam_follow.py), with these tables. At a
        block boundary where the slots already hold the block for the next position (taken for a lookahead step), a
        moved slot keeps its own and takes its parent's full blocks."""
        old = self.tables
        tables = list(old)
        size = self.kv_cache.block_size
        boundary = num_computed % size == 0
        full = num_computed // size
        for slot, parent in enumerate(parents):
            if parent == slot:
                continue
            if not boundary or len(old[parent]) > full:
                tables[slot] = old[parent][:full] + [old[slot][-1]]
                if not boundary and not copied:
                    self.kv_cache.pending_copies.append((old[parent][-1], old[slot][-1]))
            else:
                tables[slot] = list(old[parent])
            self.changed_from[slot] = 0
        self.tables = tables
        self.spread = True

    def take_changes(self) -> list[tuple[int, int, list[int]]]:
        """(slot, first changed index, the slot's table from there) for the slots changed since the last call."""
        changes = [(slot, start, self.tables[slot][start:]) for slot, start in self.changed_from.items()]
        self.changed_from.clear()
        return changes

    def free(self) -> None:
        """Give back every block (the search finished, or was preempted and will compute its slots again)."""
        self.kv_cache.release(sorted(self.held))
        self.held.clear()
        self.tables = [[] for _ in range(self.width)]
        self.spread = False
        self.changed_from = dict.fromkeys(range(self.width), 0)

    def _append(self, slot: int, count: int) -> None:
        if count <= 0:
            return
        blocks = self.kv_cache.take_blocks(count)
        self.held.update(blocks)
        table = self.tables[slot]
        self.changed_from.setdefault(slot, len(table))
        table.extend(blocks)

    def _give_back_unlisted(self) -> None:
        listed = set().union(*self.tables)
        self.kv_cache.release(sorted(self.held - listed))
        self.held = listed
