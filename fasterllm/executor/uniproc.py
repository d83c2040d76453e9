"""One rank, in the engine's own process: the executor calls the model runner directly (no copy of the step
message, no extra process)."""
from __future__ import annotations

from collections.abc import Callable

from fasterllm.config import CacheConfig, SchedulerConfig
from fasterllm.loader.checkpoint import Checkpoint
from fasterllm.worker.model_runner import PendingOutput
from fasterllm.worker.step_messages import GrammarMasks, SchedulerOutput
from fasterllm.worker.worker import WorkerConfig, call_runner, init_worker


class UniProcExecutor:
    def __init__(self, config: WorkerConfig, checkpoint: Checkpoint):
        self.runner = init_worker(config, checkpoint=checkpoint)
        self.load_seconds = self.runner.load_seconds

    def determine_num_blocks(self, cache: CacheConfig, sched: SchedulerConfig, gpu_memory_utilization: float,
                             cpu_kv_cache_gib: float) -> int:
        return self.runner.determine_num_blocks(cache, sched, gpu_memory_utilization, cpu_kv_cache_gib)

    def bytes_per_block(self, block_size: int) -> int:
        return self.runner.bytes_per_block(block_size)

    def initialize_cache(self, num_blocks: int, block_size: int, swap_blocks: int, capture_graphs: bool) -> float:
        return self.runner.initialize_cache(num_blocks, block_size, swap_blocks, capture_graphs)

    def execute(self, message: SchedulerOutput) -> PendingOutput | None:
        return self.runner.execute(message)

    def sample_with_masks(self, masks: GrammarMasks) -> None:
        self.runner.sample_with_masks(masks)

    def collective_rpc(self, method: str | Callable, *args) -> list:
        """[runner.method(*args)], or [method(runner, *args)]: the one rank's result, as MultiprocExecutor answers."""
        return [call_runner(self.runner, method, args)]

    def shutdown(self) -> None:
        pass
