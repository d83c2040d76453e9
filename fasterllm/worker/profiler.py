"""torch.profiler on every rank, started and stopped through the executor (`executor.collective_rpc(start,
...)`): a tensor-parallel step's kernels run in the worker processes, where the engine's process cannot see them."""
from __future__ import annotations

import os

import torch
from torch.profiler import ProfilerActivity, profile

from fasterllm.worker.model_runner import ModelRunner

_active: dict[int, profile] = {}  # id(runner) -> its profiler, in the rank's own process


def start(runner: ModelRunner) -> None:
    activities = [ProfilerActivity.CUDA if runner.device.type == "cuda" else ProfilerActivity.CPU]
    _active[id(runner)] = prof = profile(activities=activities)
    prof.start()


def stop(runner: ModelRunner, trace_dir: str | None = None, rows: int = 25) -> dict:
    """Stop this rank's profiler: its time in seconds (on a GPU its kernels', copies' and memsets'; on the CPU its
    operators' own), a table of what took the most, and, given trace_dir, a Chrome trace written there as
    rank<N>.json."""
    prof = _active.pop(id(runner))
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    prof.stop()
    averages = prof.key_averages()
    if trace_dir is not None:
        os.makedirs(trace_dir, exist_ok=True)
        prof.export_chrome_trace(os.path.join(trace_dir, f"rank{rank}.json"))
    gpu = runner.device.type == "cuda"
    return {"rank": rank,
            "seconds": sum(e.self_device_time_total if gpu else e.self_cpu_time_total for e in averages) / 1e6,
            "table": averages.table(sort_by="cuda_time_total" if gpu else "self_cpu_time_total", row_limit=rows,
                                    max_name_column_width=70)}
