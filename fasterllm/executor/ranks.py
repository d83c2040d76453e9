"""What an executor with one worker per rank (MultiprocExecutor, RayExecutor) answers the engine, over its own
transport: each method runs on every rank (_call) and the answers are combined here."""
from __future__ import annotations

from collections.abc import Callable

from fasterllm.config import CacheConfig, SchedulerConfig


class RankExecutor:
    def _call(self, method: str | Callable, *args) -> list:
        """runner.method(*args) (or method(runner, *args)) on every rank; the results in rank order."""
        raise NotImplementedError

    def determine_num_blocks(self, cache: CacheConfig, sched: SchedulerConfig, gpu_memory_utilization: float,
                             cpu_kv_cache_gib: float) -> int:
        """The fewest blocks any rank has room for: block ids mean the same slots on every rank."""
        return min(self._call("determine_num_blocks", cache, sched, gpu_memory_utilization, cpu_kv_cache_gib))

    def bytes_per_block(self, block_size: int) -> int:
        return self._call("bytes_per_block", block_size)[0]  # one rank's: each holds its heads' share

    def initialize_cache(self, num_blocks: int, block_size: int, swap_blocks: int, capture_graphs: bool) -> float:
        return max(self._call("initialize_cache", num_blocks, block_size, swap_blocks, capture_graphs))

    def collective_rpc(self, method: str | Callable, *args) -> list:
        """runner.method(*args), or method(runner, *args) for a module-level function, on every rank; the results in
        rank order."""
        return self._call(method, *args)
