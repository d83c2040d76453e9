"""glibc's allocator told to keep the memory a CPU step frees, for the next step.

A CPU step allocates tensors of tens of MB (128 beam rows of logits over a 58k vocabulary are 30 MB) and frees them
by its end. glibc serves such sizes with fresh mmap pages, or trims the heap's top back to the system, so every step
takes them again page by page: each first touch is a page fault, and on a VM one costs microseconds (a 30 MB
log_softmax took 32 ms inside a beam-search step, 7 ms on its own). Raising the mmap threshold to 256 MiB (32 MiB
where an older glibc refuses more) and the trim threshold to 1 GiB keeps those pages in the process, as tcmalloc or
jemalloc would, which vLLM's CPU backend asks for through LD_PRELOAD. It is a process-wide setting: an LLM made in
the caller's process sets it there too. Where the C library is not glibc nothing changes.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLDS = (256 * 2**20, 32 * 2**20)  # tried in order: an older glibc refuses above 32 MiB
TRIM_THRESHOLD = 2**30


def keep_freed_memory() -> None:
    """Set the thresholds, where the C library is glibc."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name is not None else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:
        return
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    mmap_set = any(mallopt(_M_MMAP_THRESHOLD, threshold) == 1 for threshold in MMAP_THRESHOLDS)
    if not mmap_set or mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) != 1:
        logger.info("glibc refused the allocator thresholds: freed memory goes back to the system as before")
