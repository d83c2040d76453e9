"""What the engine reports about its queues, KV cache and preemptions (the server's /metrics reads it)."""
from __future__ import annotations

from dataclasses import dataclass

from fasterllm.engine.kv_cache_manager import KVCacheManager
from fasterllm.engine.scheduler import Scheduler


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_swapped: int
    kv_cache_usage: float  # fraction of blocks referenced by requests
    num_kv_blocks: int
    num_cached_blocks: int  # blocks findable by prefix hash (in use or free)
    prefix_cache_queries: int  # prompt tokens looked up
    prefix_cache_hits: int  # of which found cached
    num_preemptions: int
    num_swapped_out: int
    num_swapped_in: int

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @staticmethod
    def collect(kv: KVCacheManager, sched: Scheduler) -> EngineStats:
        return EngineStats(len(sched.running), len(sched.waiting), len(sched.swapped), kv.usage, kv.num_blocks,
                           kv.num_cached_blocks, kv.prefix_cache_queries, kv.prefix_cache_hits,
                           sched.stats.num_preemptions, sched.stats.num_swapped_out, sched.stats.num_swapped_in)
