"""Executors: how many ranks run the model and where (DESIGN.md). The engine sends each step one SchedulerOutput to
its executor and reads the sampled tokens back; it never sees a model runner."""
from __future__ import annotations

import torch

from fasterllm.config import EngineArgs, SchedulerConfig
from fasterllm.distributed.tensor_parallel import check_tensor_parallel
from fasterllm.executor.multiproc import MultiprocExecutor
from fasterllm.executor.uniproc import UniProcExecutor
from fasterllm.loader.checkpoint import Checkpoint


def make_executor(args: EngineArgs, checkpoint: Checkpoint, max_model_len: int, sched: SchedulerConfig
                  ) -> UniProcExecutor | MultiprocExecutor:
    """UniProcExecutor (one rank, in process) or MultiprocExecutor (a process per rank), as args say; a tensor
    parallel size the model or the machine cannot take is refused before any process starts."""
    size = args.tensor_parallel_size
    check_tensor_parallel(checkpoint.config, args.quantization, size)
    if args.resolve_device().type == "cuda" and size > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size={size} needs {size} GPUs but this machine has "
                         f"{torch.cuda.device_count()}; use tensor_parallel_size <= {torch.cuda.device_count()}")
    if size == 1 and args.distributed_executor_backend in (None, "uni"):
        return UniProcExecutor(args, max_model_len, sched, checkpoint)
    return MultiprocExecutor(args, max_model_len, sched)
