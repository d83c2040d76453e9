"""The beam selection replayed from CUDA graphs: its ~40 small tensor operations cost the host more to launch one by
one (about 3.5 ms a step for 64 searches on an H100) than the GPU spends running them, and a beam step cannot hide
its host work behind the GPU (its next inputs are this selection).

A graph is captured the first time its key is needed: (searches rounded up to a power of two, the widest width, the
most candidates, the most eos ids). Its inputs are staged into its own buffers: the logits rows (a device copy), the
host rows of SelectionInputs (one copy each); searches past the real ones select nothing (worker/beam_search.py's
padding), and their output columns are dropped on the host. The graphs share one memory pool: they replay one after
another on one stream, and each replay's outputs are copied to the host right behind it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fasterllm.worker.beam_follow import PreviousSelection
from fasterllm.worker.beam_search import PendingSelection, SearchState, select, selection_inputs
from fasterllm.worker.step_messages import SearchChunks


@dataclass
class _CapturedSelection:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # [searches x width, V]: the graph reads the logits rows from here
    ints: torch.Tensor
    scores: torch.Tensor
    outputs: tuple[torch.Tensor, torch.Tensor]


class SelectionGraphs:
    def __init__(self, device: torch.device):
        self.device = device
        self.captured: dict[tuple[int, int, int, int, int], _CapturedSelection] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def select(self, logits: torch.Tensor, chunks: SearchChunks, searches: dict[str, SearchState],
               previous: PreviousSelection | None) -> PendingSelection:
        """logits: [rows, V] fp32 of the selecting searches' computing slots, search after search (at most a search's
        width rows each); previous: the last step's selection, which following searches' inputs come from."""
        picked = [searches[search_id] for search_id, selects in zip(chunks.search_ids, chunks.selects) if selects]
        num_searches = 1 << (len(picked) - 1).bit_length()
        width = max(state.width for state in picked)
        key = (num_searches, width, max(state.num_candidates for state in picked),
               max(1, max(len(state.eos_token_ids) for state in picked)), logits.shape[1])
        captured = self.captured.get(key) or self._capture(*key)
        rows = num_searches * width
        inputs = selection_inputs(chunks, searches, rows, previous)
        inputs.pad(num_searches, rows)
        captured.logits[:logits.shape[0]].copy_(logits)
        inputs.to_device(captured.ints, captured.scores, previous)
        captured.graph.replay()
        return PendingSelection(inputs.search_ids, *captured.outputs)

    def _capture(self, num_searches: int, width: int, num_candidates: int, num_eos: int,
                 vocab: int) -> _CapturedSelection:
        logits = torch.zeros(num_searches * width, vocab, dtype=torch.float32, device=self.device)
        # searches that select nothing: a harmless input to warm up and capture on
        ints = torch.tensor([[num_searches * width] * width + list(range(width)) + [-1] * num_eos + [0, 0]]
                            * num_searches, device=self.device)
        scores = torch.full((num_searches, width), float("-inf"), device=self.device)
        select(logits, ints, scores, width, num_candidates, num_eos)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        # thread_local: the server's generating engine may launch work from its own thread meanwhile
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            outputs = select(logits, ints, scores, width, num_candidates, num_eos)
        captured = _CapturedSelection(graph, logits, ints, scores, outputs)
        self.captured[(num_searches, width, num_candidates, num_eos, vocab)] = captured
        return captured
