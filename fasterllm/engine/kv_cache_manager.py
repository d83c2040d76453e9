"""The block pool and each request's block table. Blocks hold block_size tokens of KV for every layer."""
from __future__ import annotations

from collections import deque

from fasterllm.engine.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.block_tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        """Fraction of the pool in use, 0..1."""
        return 1.0 - len(self.free_blocks) / self.num_blocks

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Grow the request's table to hold num_new_tokens more; False (and nothing taken) if the pool is short."""
        table = self.block_tables.setdefault(request.request_id, [])
        needed = self.blocks_for_tokens(request.num_computed_tokens + num_new_tokens) - len(table)
        if needed > len(self.free_blocks):
            return False
        table.extend(self.free_blocks.popleft() for _ in range(needed))
        return True

    def free(self, request: Request) -> None:
        self.free_blocks.extend(self.block_tables.pop(request.request_id, []))

    def block_table(self, request_id: str) -> list[int]:
        return self.block_tables[request_id]
