"""The heap is frozen out of the garbage collector while generating and given back after, so an engine the caller
drops later is still collected; a caller's own freeze is left alone."""
from __future__ import annotations

import gc
import weakref

from fasterllm.engine.frozen_heap import heap_frozen_while_generating


class Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic collector frees it


def test_objects_alive_while_generating_are_collected_after_it():
    node = Node()
    alive = weakref.ref(node)
    with heap_frozen_while_generating():
        assert gc.get_freeze_count() > 0
        del node
        gc.collect()
        assert alive() is not None  # frozen: no collection walks it
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert alive() is None


def test_a_callers_own_freeze_is_left_as_it_is():
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with heap_frozen_while_generating():
            pass
        assert gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()
