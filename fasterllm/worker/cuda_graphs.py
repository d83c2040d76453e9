"""Decode steps replayed from CUDA graphs: one graph per bucketed batch size, captured at start-up.

A decode step of a small model is a few hundred short kernel launches; launching them from Python
costs more than running them. A graph records the launches once over the fixed input buffers
(worker/input_buffers.py) and replays them with one call. A batch is padded up to the next captured
size; padding rows store nothing and own no query rows. Each size also has a graph of its logits' argmax (greedy
sampling), replayed only by a step that samples greedily: about 3 us of the host against 50 for its two launches.
"""
from __future__ import annotations

import logging
import time

import torch

from fasterllm.worker.input_buffers import InputBuffers
from fasterllm.worker.sampler import row_argmax

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 256 + 1, 16))
    return [s for s in sizes if s < max_num_seqs] + [max_num_seqs] if max_num_seqs <= 256 else sizes


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, buffers: InputBuffers, kv_caches: torch.Tensor,
                 encoder_decoder: bool = False):
        self.model, self.buffers, self.kv_caches = model, buffers, kv_caches
        self.encoder_decoder = encoder_decoder  # its graphs read the cross tables' buffers too
        # the buffers were sized from max_num_seqs and max_num_batched_tokens
        self.sizes = graph_batch_sizes(min(buffers.max_tokens, buffers.max_seqs))
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.argmax_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # each size's, its ids
        self.pool = None

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every size, largest first (smaller graphs reuse its memory pool). Returns seconds."""
        start = time.perf_counter()
        for size in sorted(self.sizes, reverse=True):
            # a harmless batch: every row one token that is stored nowhere and sees only itself
            cross = ([1] * size, [[0]] * size) if self.encoder_decoder else None
            batch = self.buffers.stage([0] * size, [1] * size, [1] * size, [[0]] * size, list(range(size)), cross=cross)
            batch.meta.slot_mapping.fill_(-1)
            self._forward(batch)  # compiles and autotunes outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.logits[size] = self._forward(batch)
            self.pool = graph.pool()
            self.graphs[size] = graph
            row_argmax(self.logits[size])  # compiled outside the capture
            argmax_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(argmax_graph, pool=self.pool):
                self.argmax_graphs[size] = (argmax_graph, row_argmax(self.logits[size]))
        self.buffers.compile_advance()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        logger.info("captured %d decode CUDA graphs (batch sizes %s) in %.1fs", len(self.sizes),
                    ",".join(map(str, self.sizes)), seconds)
        return seconds

    def _forward(self, batch) -> torch.Tensor:
        return self.model(batch.input_ids, batch.meta.positions, self.kv_caches, batch.meta, batch.logits_indices)

    def padded_size(self, num_seqs: int) -> int | None:
        """The smallest captured size that holds num_seqs decode rows, or None."""
        return next((s for s in self.sizes if s >= num_seqs), None)

    def replay(self, size: int, num_rows: int) -> torch.Tensor:
        """Run the graph of `size` over the staged inputs; the first num_rows rows of its logits."""
        self.graphs[size].replay()
        return self.logits[size][:num_rows]

    def argmax(self, logits: torch.Tensor) -> torch.Tensor | None:
        """Each row's argmax of logits that are the first rows of a replay's logits, from that size's argmax graph;
        None for any other logits. Like the logits, the ids are valid until the next replay of a decode graph (the
        graphs share one memory pool): read them, or queue what reads them, before it."""
        for size, replayed in self.logits.items():
            if (logits.data_ptr() == replayed.data_ptr() and logits.dim() == 2 and logits.shape[0] <= size
                    and logits.stride() == replayed.stride()):
                graph, ids = self.argmax_graphs[size]
                graph.replay()
                return ids[:logits.shape[0]]
        return None
