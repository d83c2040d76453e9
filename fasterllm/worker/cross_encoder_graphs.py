"""An encoder-decoder model's encoder pass (packed encoder inputs -> every decoder layer's cross K/V, stored by
slot) replayed from CUDA graphs, one per (token bucket, sequence bucket) as the BERT encoder's (encoder_graphs.py),
sharing one memory pool; every bucket a step can fill is captured at start-up (a bucket first met while serving would
hold that step for its capture).

Run eagerly the pass is ~140 launches, about 5 ms of an H200's host whatever the batch (one request of 128 tokens or
64 of them), where the GPU runs a small batch in a fraction of that: every step that admits requests paid it. The
inputs are staged as the BERT graphs stage theirs (encoder_inputs.py: padding rows of token 0 at position 0, in empty
sequences) beside each token's cross slot, -1 for the padding rows, which store nothing.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from fasterllm.layers.varlen_attention import VarlenBatch
from fasterllm.worker.encoder_graphs import MIN_SEQ_BUCKET, TOKEN_BUCKETS, bucket, capture_pass


def startup_buckets(max_tokens: int, max_seqs: int) -> list[tuple[int, int]]:
    """The (token, sequence) bucket of every batch of n <= max_tokens tokens (up to the largest bucket) in s <=
    min(n, max_seqs) inputs, largest first."""
    most_tokens, most_seqs = bucket(min(max_tokens, TOKEN_BUCKETS[-1]), max(1, max_seqs))
    keys = []
    for tokens in reversed([t for t in TOKEN_BUCKETS if t <= most_tokens]):
        for seqs in reversed([MIN_SEQ_BUCKET << i for i in range(16) if MIN_SEQ_BUCKET << i <= most_seqs]):
            # a batch has a token per input at least: the fewest inputs of a bucket past the first is half its own
            if seqs == MIN_SEQ_BUCKET or seqs // 2 < tokens:
                keys.append((tokens, seqs))
    return keys


@dataclass
class _CapturedPass:
    graph: torch.cuda.CUDAGraph
    inputs: torch.Tensor  # token ids, positions and cu_seqlens (int32), as stage_packed_inputs lays them out
    slots: torch.Tensor  # [token capacity] int64: each row's cross slot


class CrossEncoderGraphs:
    def __init__(self, model: torch.nn.Module, kv_caches: torch.Tensor, device: torch.device, max_seqlen: int):
        """model: one whose replayable_encoder is set; max_seqlen: the longest encoder input (the attention grid's
        rows per sequence)."""
        self.model, self.kv_caches, self.device, self.max_seqlen = model, kv_caches, device, max_seqlen
        self.captured: dict[tuple[int, int], _CapturedPass] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, max_tokens: int, max_seqs: int) -> float:
        """Capture the bucket of every batch of up to max_tokens tokens in up to max_seqs inputs, largest first (the
        smaller graphs' work fits in the memory the pool already holds); returns seconds."""
        start = time.perf_counter()
        for key in startup_buckets(max_tokens, max_seqs):
            self._capture(*key)
        return time.perf_counter() - start

    def run(self, capacity: tuple[int, int], staged: torch.Tensor, slots: np.ndarray) -> None:
        """The encoder pass of the bucket capacity (token, sequence capacities) over its staged inputs
        (encoder_inputs.stage_packed_inputs, pinned), their cross K/V stored at slots (one per real token, packed
        in order)."""
        captured = self.captured.get(capacity) or self._capture(*capacity)
        host_slots = torch.full((capacity[0],), -1, dtype=torch.long, pin_memory=True)
        host_slots[:len(slots)] = torch.from_numpy(slots)
        captured.inputs.copy_(staged, non_blocking=True)
        captured.slots.copy_(host_slots, non_blocking=True)
        captured.graph.replay()

    def _capture(self, token_capacity: int, seq_capacity: int) -> _CapturedPass:
        slots = torch.full((token_capacity,), -1, dtype=torch.long, device=self.device)  # nothing stored meanwhile

        def encode(token_ids: torch.Tensor, positions: torch.Tensor, batch: VarlenBatch) -> None:
            self.model.encode(token_ids, positions, batch, self.kv_caches, slots)

        graph, inputs, _ = capture_pass(encode, token_capacity, seq_capacity, self.device, self.max_seqlen, self.pool)
        captured = _CapturedPass(graph, inputs, slots)
        self.captured[(token_capacity, seq_capacity)] = captured
        return captured
