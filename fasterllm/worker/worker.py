"""One rank, started: its device, its process group, its shard of the model, ready for the KV cache.

Every executor starts its ranks here (in process, or in a worker process of its own); the engine talks to the
ModelRunner this returns only through the executor.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from collections.abc import Callable

import torch

from fasterllm.config import EngineArgs, SchedulerConfig
from fasterllm.distributed.symmetric_all_reduce import try_symmetric_all_reduce
from fasterllm.distributed.tensor_parallel import init_tensor_parallel
from fasterllm.loader.checkpoint import Checkpoint, open_checkpoint
from fasterllm.worker.cpu_heap import keep_freed_memory
from fasterllm.worker.model_runner import ModelRunner


@dataclass
class WorkerConfig:
    """What every rank is started with (picklable: it travels to worker processes and Ray actors)."""

    args: EngineArgs
    max_model_len: int
    sched: SchedulerConfig
    dtype: torch.dtype  # resolved once, by the engine


def init_worker(config: WorkerConfig, rank: int = 0, init_method: str | None = None,
                checkpoint: Checkpoint | None = None, local_gpu: int | None = None) -> ModelRunner:
    """Rank `rank` of args.tensor_parallel_size: GPU local_gpu of those this process sees (rank unless given: a
    Ray actor sees only its own GPU, 0), or the CPU, whose cores the ranks share; joined to the others at
    init_method. The checkpoint is read again unless given (one rank in process)."""
    args = config.args
    size = args.tensor_parallel_size
    device = args.resolve_device()
    if device.type == "cuda" and size > 1:
        device = torch.device("cuda", rank if local_gpu is None else local_gpu)
        torch.cuda.set_device(device)
    elif device.type == "cpu" and size > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    if device.type == "cpu":
        keep_freed_memory()
    torch.manual_seed(args.seed)  # every rank alike: they sample the same tokens from the same logits
    tp = init_tensor_parallel(rank, size, init_method, device)
    checkpoint = checkpoint or open_checkpoint(args.model, args.tokenizer)
    if device.type == "cuda" and size > 1 and not args.disable_custom_all_reduce:
        tp = replace(tp, symmetric=try_symmetric_all_reduce(checkpoint.config.hidden_size, config.dtype,
                                                                        device))
    runner = ModelRunner(checkpoint, config.max_model_len, device, config.dtype, args.load_format, args.quantization,
                         tp, args.resolve_cache_dtype(config.dtype, checkpoint.kv_cache_scales is not None))
    runner.prepare_inputs(args.block_size, config.sched)
    return runner


def call_runner(runner: ModelRunner, method: str | Callable, args: tuple):
    """runner.method(*args), or method(runner, *args) for a module-level function (an executor's collective_rpc)."""
    return method(runner, *args) if callable(method) else getattr(runner, method)(*args)
