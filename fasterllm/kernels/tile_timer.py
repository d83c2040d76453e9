"""The tile of a matrix-vector kernel, timed on the GPU per shape (gemv.py, fused_moe.py's few-slot launches,
int4_gemv.py, int8_gemv.py, int4_mma.py with its form): the best tile depends on the shape and the GPU, so a shape's
first call times each candidate (CUDA events, outside any graph capture, L2 flushed between runs) and keeps the
fastest for every later call."""
from __future__ import annotations

import torch

_chosen: dict[tuple, tuple] = {}
_QUEUE_CYCLES = 10_000_000  # ~5 ms of GPU clock: enough to queue the timed runs behind it


def timed_tile(key: tuple, launch, candidates: list[tuple], default: tuple) -> tuple:
    """The fastest of candidates (a kernel's tiles) for key (a shape; the device last), launch(tile) timed on its first
    call on a GPU; default where none is timed (the CPU interpreter, a graph capture's first call)."""
    if key in _chosen:
        return _chosen[key]
    device = key[-1]
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return default
    # decode reads W from HBM, not from L2: a buffer twice the L2 is written between runs
    flush = torch.empty(2 * torch.cuda.get_device_properties(device).L2_cache_size, dtype=torch.uint8, device=device)
    timings = {}
    for config in candidates:
        launch(config)  # compile
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(7)]
        # the GPU sleeps while the runs are queued behind it, so the events time the kernels, not their Python
        # launches (which take longer than a small projection's kernel and made the choice a coin toss)
        torch.cuda._sleep(_QUEUE_CYCLES)
        for start, end in events:
            flush.zero_()
            start.record()
            launch(config)
            end.record()
        torch.cuda.synchronize(device)
        timings[config] = sorted(start.elapsed_time(end) for start, end in events)[len(events) // 2]
    _chosen[key] = min(timings, key=timings.get)
    return _chosen[key]


def chosen_tiles() -> dict[tuple, tuple[int, ...]]:
    """Each key timed so far -> its fastest tile (gemv.py's keys (N, K, weight dtype, group, grouped bits, x dtype,
    device) -> (BLOCK_N, BLOCK_B, num_warps); the other kernels' keys start with their name)."""
    return dict(_chosen)
