"""One rank, started: its device, its process group, its shard of the model, ready for the KV cache.

Every executor starts its ranks here (in process, or in a worker process of its own); the engine talks to the
ModelRunner this returns only through the executor.
"""
from __future__ import annotations

import os

import torch

from fasterllm.config import EngineArgs, SchedulerConfig
from fasterllm.distributed.tensor_parallel import init_tensor_parallel
from fasterllm.loader.checkpoint import Checkpoint, open_checkpoint
from fasterllm.worker.model_runner import ModelRunner


def init_worker(args: EngineArgs, max_model_len: int, sched: SchedulerConfig, rank: int = 0,
                init_method: str | None = None, checkpoint: Checkpoint | None = None) -> ModelRunner:
    """Rank `rank` of args.tensor_parallel_size: GPU `rank` of this machine (or the CPU, whose cores the ranks
    share), joined to the others at init_method; the checkpoint is read again unless given (one rank in process)."""
    size = args.tensor_parallel_size
    device = args.resolve_device()
    if device.type == "cuda" and size > 1:
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    elif device.type == "cpu" and size > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    dtype = args.resolve_dtype(device)
    torch.manual_seed(args.seed)  # every rank alike: they sample the same tokens from the same logits
    tp = init_tensor_parallel(rank, size, init_method, device)
    checkpoint = checkpoint or open_checkpoint(args.model, args.tokenizer)
    runner = ModelRunner(checkpoint, max_model_len, device, dtype, args.load_format, args.quantization, tp)
    runner.prepare_inputs(args.block_size, sched)
    return runner
