"""Python's cyclic garbage collector against the engine's long-lived objects.

Each step of a large batch creates thousands of small objects (a RequestOutput per request, lists of token ids),
enough to start collections every step; now and then a full one walks every object the process holds (the model's
modules, the block pool, the tokenizer), which at hundreds of requests costs more than the step's own work. Freezing
the heap built before generation (gc.freeze: those objects move to a generation no collection walks) keeps
collections to what generation itself creates, as vLLM's engine core does after start-up.
"""
from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


def freeze_heap() -> None:
    """For a process that runs an engine until it exits (the engine core's): everything alive now is frozen for good."""
    gc.collect()
    gc.freeze()


@contextmanager
def heap_frozen_while_generating() -> Iterator[None]:
    """For generation inside the caller's process: the heap is frozen for the duration and unfrozen after it, so a
    cycle among objects alive now (an engine the caller drops later) is still collected then. A caller that froze
    objects itself is left as it is."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
