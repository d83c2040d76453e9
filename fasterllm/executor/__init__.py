"""Executors: how many ranks run the model and where (DESIGN.md). The engine sends each step one SchedulerOutput to
its executor and reads the sampled tokens back; it never sees a model runner."""
from __future__ import annotations

import torch

from fasterllm.distributed.tensor_parallel import check_tensor_parallel
from fasterllm.executor.multiproc import MultiprocExecutor
from fasterllm.executor.ray_executor import RayExecutor
from fasterllm.executor.uniproc import UniProcExecutor
from fasterllm.loader.checkpoint import Checkpoint
from fasterllm.worker.worker import WorkerConfig


def make_executor(config: WorkerConfig, checkpoint: Checkpoint) -> UniProcExecutor | MultiprocExecutor | RayExecutor:
    """UniProcExecutor (one rank, in process), MultiprocExecutor (a process per rank on this machine) or RayExecutor
    (a Ray actor per rank, across a cluster's nodes), as args say; a tensor parallel size the model or this machine
    cannot take is refused before any process starts."""
    args = config.args
    size = args.tensor_parallel_size
    check_tensor_parallel(checkpoint.config, checkpoint.resolve_quantization(args.quantization), size)
    if args.resolve_device().type == "cuda" and size > torch.cuda.device_count() and \
            args.distributed_executor_backend != "ray":  # a Ray cluster's GPUs may be on other nodes
        raise ValueError(f"tensor_parallel_size={size} needs {size} GPUs but this machine has "
                         f"{torch.cuda.device_count()}; use tensor_parallel_size <= {torch.cuda.device_count()}")
    if size == 1 and args.distributed_executor_backend in (None, "uni"):
        return UniProcExecutor(config, checkpoint)
    if args.distributed_executor_backend == "ray":
        return RayExecutor(config)
    return MultiprocExecutor(config)
