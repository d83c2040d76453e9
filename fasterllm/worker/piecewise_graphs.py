"""Steps with prompt chunks beside decodes, replayed from CUDA graphs in pieces around attention.

A decode step replays one graph per batch size (cuda_graphs.py): its attention grid depends on the number of
sequences only. A step that carries prompt chunks has a different attention grid for every mix of lengths, but the
rest of the network (projections, norms, RoPE and the KV store, the MLP) depends on its number of tokens only. So
for each bucket of token counts the forward pass is captured as one graph per stretch between two attention calls,
and each layer's attention runs eagerly between them, on the step's own sequences (as vLLM's piecewise graphs do).
Launched from Python, such a step costs a few hundred kernel launches; replayed, a few dozen calls.

A step pads to the next bucket: padding rows store nothing (slot -1) and belong to no sequence. The output head
runs after the last piece, on the logits rows alone. Steps longer than the largest bucket run eagerly: their GPU
time hides the launches.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from fasterllm.layers.attention import KernelInputs
from fasterllm.worker.input_buffers import InputBuffers

logger = logging.getLogger(__name__)


def piecewise_token_sizes(max_tokens: int) -> list[int]:
    sizes = list(range(16, 256 + 1, 16)) + list(range(288, 512 + 1, 32))
    return [s for s in sizes if s <= max_tokens]


class PiecewiseCapture:
    """The pieces of one bucket's forward pass. The attention layer calls split_at while it is being captured: the
    piece being captured ends there, the attention to run at that point is recorded, and the next piece begins."""

    def __init__(self, pool) -> None:
        self.pool = pool
        self.pieces: list[torch.cuda.CUDAGraph] = []
        self.attentions: list[Callable[[KernelInputs], torch.Tensor]] = []
        self._begin()

    def _begin(self) -> None:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.pool)
        self.pieces.append(graph)

    def split_at(self, attend: Callable[[KernelInputs, torch.Tensor], torch.Tensor],
                 query: torch.Tensor) -> torch.Tensor:
        """attend(kernel inputs, out) attends the step's queries (in `query`, which the piece before writes) into
        out; returns out, which the piece after reads."""
        out = torch.empty_like(query)
        self.pieces[-1].capture_end()
        self.attentions.append(lambda kernel: attend(kernel, out))
        self._begin()
        return out

    def end(self) -> None:
        self.pieces[-1].capture_end()

    def replay(self, kernel: KernelInputs) -> None:
        for piece, attend in zip(self.pieces, self.attentions):
            piece.replay()
            attend(kernel)
        self.pieces[-1].replay()


class PiecewiseGraphs:
    def __init__(self, model: torch.nn.Module, buffers: InputBuffers, kv_caches: torch.Tensor):
        self.model, self.buffers, self.kv_caches = model, buffers, kv_caches
        self.sizes = piecewise_token_sizes(buffers.max_tokens)
        self.captured: dict[int, tuple[PiecewiseCapture, torch.Tensor]] = {}  # size -> (pieces, final hidden)

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every bucket, largest first, in one memory pool (they never run at once). Returns seconds."""
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        for size in sorted(self.sizes, reverse=True):
            # a harmless batch: one sequence of `size` tokens over block 0, storing nothing
            blocks = -(-size // self.buffers.block_size)
            batch = self.buffers.stage([0] * size, [size], [size], [[0] * blocks], [size - 1])
            batch.meta.slot_mapping.fill_(-1)
            self._hidden(batch)  # compiles and picks kernels outside the capture
            torch.cuda.synchronize()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                batch.meta.pieces = capture = PiecewiseCapture(pool)
                hidden = self._hidden(batch)
                capture.end()
            batch.meta.pieces = None
            torch.cuda.current_stream().wait_stream(stream)
            self.captured[size] = (capture, hidden)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        logger.info("captured piecewise CUDA graphs for steps of up to %d tokens (%d sizes, %d pieces each) in %.1fs",
                    max(self.sizes, default=0), len(self.sizes), len(capture.pieces) if self.sizes else 0, seconds)
        return seconds

    def _hidden(self, batch) -> torch.Tensor:
        return self.model.hidden_states(batch.input_ids, batch.meta.positions, self.kv_caches, batch.meta)

    def padded_size(self, num_tokens: int) -> int | None:
        """The smallest captured size that holds num_tokens, or None."""
        return next((s for s in self.sizes if s >= num_tokens), None)

    def replay(self, size: int, kernel: KernelInputs, logits_indices: torch.Tensor) -> torch.Tensor:
        """The staged step through the bucket of `size` tokens -> fp32 logits of the logits rows."""
        capture, hidden = self.captured[size]
        capture.replay(kernel)
        return self.model.compute_logits(hidden[logits_indices])
