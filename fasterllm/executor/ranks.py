"""What an executor with one worker per rank (MultiprocExecutor, RayExecutor) answers the engine, over its own
transport: each method runs on every rank (_call) and the answers are combined here; a failed rank fails them all."""
from __future__ import annotations

import logging
from collections.abc import Callable

from fasterllm.config import CacheConfig, SchedulerConfig
from fasterllm.errors import WorkerFailedError
from fasterllm.worker.step_messages import ModelRunnerOutput

logger = logging.getLogger("fasterllm")


class RankExecutor:
    num_ranks: int
    rank_label = ""  # how a failure names the kind of rank, after its number
    _failure: WorkerFailedError | None = None

    # ---- the transport (each subclass's) ------------------------------------------------------------------
    def _call(self, method: str | Callable, *args) -> list:
        """runner.method(*args) (or method(runner, *args)) on every rank; the results in rank order."""
        raise NotImplementedError

    def _rank0_output(self) -> ModelRunnerOutput:
        """Rank 0's output of the oldest step not read yet."""
        raise NotImplementedError

    def _stop_ranks(self) -> None:
        """Stop every rank at once, even one waiting in a collective for a failed one."""
        raise NotImplementedError

    # ---- failures -----------------------------------------------------------------------------------------
    def _fail(self, rank: int, reason: str) -> None:
        self._failure = WorkerFailedError(f"tensor-parallel rank {rank} of {self.num_ranks} failed{self.rank_label}; "
                                          f"every rank is stopped and the engine cannot go on (make a new one):\n"
                                          f"{reason}")
        logger.error("%s", self._failure)
        self._stop_ranks()
        raise self._failure

    def _check_alive(self) -> None:
        if self._failure is not None:
            raise self._failure

    # ---- what the engine calls ----------------------------------------------------------------------------

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


class RankOutput:
    """A step launched on the ranks: get() waits for rank 0's sampled tokens (steps answer in launch order).
    request_ids: the request of each sampled row, known before the tokens (the lookahead step reads them)."""

    def __init__(self, executor: RankExecutor, request_ids: list[str]):
        self._executor, self.request_ids = executor, request_ids

    def get(self) -> ModelRunnerOutput:
        return self._executor._rank0_output()
