"""The block pool, block tables, and the prefix cache.

Blocks hold block_size tokens of KV for every layer. A full block is identified by a hash chained
from its parent block's hash and its own token ids, so equal hashes mean equal prefixes. Reference
counts let many requests share a block; a block whose count drops to zero keeps its contents and its
hash and stays findable in the free queue until it is reused, least recently freed first.
"""
from __future__ import annotations

from collections import OrderedDict

from fasterllm.engine.request import Request


def block_hash(parent: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((parent, token_ids))


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[int | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # hash -> block id
        # blocks with no reference, in eviction order (front = evicted first)
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.block_tables: dict[str, list[int]] = {}
        self.num_registered: dict[str, int] = {}  # leading blocks of each table already offered to the cache
        self.pending_copies: list[tuple[int, int]] = []  # copy-on-write (source, destination) for the runner
        self.changed_from: dict[str, int] = {}  # per table, the first index changed since the worker was told
        # encoder-decoder requests: the blocks of the encoder's K/V for every decoder layer (a second cache group,
        # from the same pool), taken at admission, shared by reference with forks, never written after the encoder
        self.cross_tables: dict[str, list[int]] = {}
        self.cross_changed: set[str] = set()  # cross tables the worker has not been sent
        self.prefix_cache_queries = 0  # prompt tokens looked up
        self.prefix_cache_hits = 0  # of which found in the cache

    # ---- sizes -----------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    @property
    def usage(self) -> float:
        """Fraction of the pool referenced by requests, 0..1 (free cached blocks count as free)."""
        return 1.0 - len(self.free_queue) / self.num_blocks

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, request_id: str) -> list[int]:
        return self.block_tables.get(request_id, [])

    def take_table_changes(self, request_ids: set[str]) -> dict[str, tuple[int, list[int]]]:
        """For those of the requests whose table changed since the last call: (first changed index, the table
        from there on). Others' changes wait for the step that schedules them."""
        changes = {}
        for request_id in [r for r in self.changed_from if r in request_ids]:  # few: tables grow every block
            start = self.changed_from.pop(request_id)
            changes[request_id] = (start, self.block_tables.get(request_id, [])[start:])
        return changes

    def take_cross_tables(self, request_ids: set[str]) -> dict[str, list[int]]:
        """The new cross tables of those requests (others' wait for the step that schedules them)."""
        sent = {r: self.cross_tables[r] for r in self.cross_changed if r in request_ids}
        self.cross_changed -= sent.keys()
        return sent

    def _changed(self, request_id: str, index: int) -> None:
        self.changed_from[request_id] = min(index, self.changed_from.get(request_id, index))

    # ---- prefix cache ----------------------------------------------------------------------------------
    def match_prefix(self, request: Request) -> int:
        """Give a request with nothing computed the cached blocks of its longest cached prefix.

        Returns the number of tokens covered; at least one token is always left to compute, so the
        step that finishes the prompt has logits to sample from.
        """
        assert request.num_computed_tokens == 0 and not self.block_tables.get(request.request_id)
        if not self.enable_prefix_caching or request.prompt_logprobs is not None:
            return 0  # prompt logprobs need every prompt position computed
        self.prefix_cache_queries += request.num_tokens
        hits: list[int] = []
        for index, h in enumerate(self._full_block_hashes(request, (request.num_tokens - 1) // self.block_size)):
            block = self.cached.get(h)
            start = index * self.block_size
            if block is None or self.block_tokens[block] != tuple(request.all_token_ids[start:start + self.block_size]):
                break  # a miss, or a hash collision caught by comparing the tokens
            hits.append(block)
        for block in hits:
            self._reference(block)
        self.block_tables[request.request_id] = hits
        self._changed(request.request_id, 0)
        self.prefix_cache_hits += len(hits) * self.block_size
        return len(hits) * self.block_size

    def undo_match(self, request: Request, num_hit_tokens: int) -> None:
        """Give back what match_prefix took when the request could not be admitted after all."""
        self.free(request)
        if self.enable_prefix_caching and request.prompt_logprobs is None:
            self.prefix_cache_queries -= request.num_tokens
            self.prefix_cache_hits -= num_hit_tokens

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's blocks that are full and computed, so later requests can reuse them."""
        if not self.enable_prefix_caching:
            return
        table = self.block_tables.get(request.request_id, [])
        num_full = min(request.num_computed_tokens // self.block_size, len(table))
        start = self.num_registered.get(request.request_id, 0)
        if num_full <= start:
            return
        self.num_registered[request.request_id] = num_full
        hashes = self._full_block_hashes(request, num_full)
        for index in range(start, num_full):
            block, h = table[index], hashes[index]
            if self.block_hashes[block] is not None or h in self.cached:
                continue  # already registered, or the same content lives in another block
            first = index * self.block_size
            self.block_hashes[block] = h
            self.block_tokens[block] = tuple(request.all_token_ids[first:first + self.block_size])
            self.cached[h] = block

    def _full_block_hashes(self, request: Request, count: int) -> list[int]:
        hashes = request.block_hashes
        while len(hashes) < count:  # computed once per block of the request, then kept
            start = len(hashes) * self.block_size
            parent = hashes[-1] if hashes else None
            hashes.append(block_hash(parent, tuple(request.all_token_ids[start:start + self.block_size])))
        return hashes[:count]

    # ---- allocation ------------------------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int, reserve: int = 0) -> bool:
        """Grow the request's table to hold num_new_tokens more, keeping `reserve` blocks free.

        A shared block about to be written is replaced by a private copy first (copy-on-write).
        Returns False, taking nothing, when the pool is short.
        """
        table = self.block_tables.get(request.request_id)
        if table is None:
            table = self.block_tables[request.request_id] = []
        computed = request.num_computed_tokens
        index = computed // self.block_size  # the block the next token goes into: shared with another request?
        shared = index if index < len(table) and self.ref_counts[table[index]] > 1 else None
        needed = self.blocks_for_tokens(computed + num_new_tokens) - len(table)
        if needed <= 0 and shared is None and table and not reserve:  # the common decode step: nothing to do
            return True
        # blocks the table holds beyond what it needs do not pay for a copy-on-write block
        if max(needed, 0) + (shared is not None) + reserve > len(self.free_queue):
            return False
        if shared is not None:
            source = table[shared]
            table[shared] = self._take_free_block()
            self.ref_counts[source] -= 1
            self.pending_copies.append((source, table[shared]))
            self._changed(request.request_id, shared)
        if needed > 0 or not table:
            self._changed(request.request_id, len(table))
        table.extend(self._take_free_block() for _ in range(needed))
        return True

    def allocate_cross(self, request: Request, reserve: int = 0) -> bool:
        """An encoder-decoder request's cross blocks, one per block_size encoder tokens, unless it holds them
        already; False, taking nothing, when the pool (less `reserve`) is short."""
        if request.encoder_token_ids is None or request.request_id in self.cross_tables:
            return True
        needed = self.blocks_for_tokens(len(request.encoder_token_ids))
        if needed + reserve > len(self.free_queue):
            return False
        self.cross_tables[request.request_id] = [self._take_free_block() for _ in range(needed)]
        self.cross_changed.add(request.request_id)
        return True

    def fork(self, parent: Request, child: Request) -> None:
        """The child shares every block of the parent's table (copy-on-write when either writes) and its cross
        blocks (only read)."""
        table = list(self.block_tables[parent.request_id])
        cross = list(self.cross_tables.get(parent.request_id, []))
        for block in table + cross:
            self._reference(block)
        self.block_tables[child.request_id] = table
        self._changed(child.request_id, 0)
        if parent.request_id in self.cross_tables:
            self.cross_tables[child.request_id] = cross
            self.cross_changed.add(child.request_id)
        self.num_registered[child.request_id] = self.num_registered.get(parent.request_id, 0)

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def free(self, request: Request) -> None:
        """Drop the request's references; its tail blocks become the first candidates for eviction."""
        self.num_registered.pop(request.request_id, None)
        self.changed_from.pop(request.request_id, None)
        self.cross_changed.discard(request.request_id)
        self.release(self.cross_tables.pop(request.request_id, []) + self.block_tables.pop(request.request_id, []))

    def take_blocks(self, count: int) -> list[int]:
        """count free blocks, each with one reference (the caller checked that num_free_blocks suffices)."""
        return [self._take_free_block() for _ in range(count)]

    def release(self, blocks: list[int]) -> None:
        """Drop one reference to each block; the last of them become the first candidates for eviction."""
        for block in reversed(blocks):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_queue[block] = None

    def _reference(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self.free_queue[block]
        self.ref_counts[block] += 1

    def _take_free_block(self) -> int:
        block, _ = self.free_queue.popitem(last=False)
        if self.block_hashes[block] is not None:  # evict its cached contents
            del self.cached[self.block_hashes[block]]
            self.block_hashes[block] = None
            self.block_tokens[block] = None
        self.ref_counts[block] = 1
        return block


class SwapSpace:
    """Block ids of the CPU pool that swapped-out requests' KV is copied into."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.free_blocks = list(range(num_blocks))
        self.tables: dict[str, list[int]] = {}

    def can_hold(self, num_blocks: int) -> bool:
        return num_blocks <= len(self.free_blocks)

    def take(self, request_id: str, num_blocks: int) -> list[int]:
        blocks = [self.free_blocks.pop() for _ in range(num_blocks)]
        self.tables[request_id] = blocks
        return blocks

    def release(self, request_id: str) -> list[int]:
        blocks = self.tables.pop(request_id, [])
        self.free_blocks.extend(blocks)
        return blocks
