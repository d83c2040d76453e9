"""CUDA graphs of the encoder's forward pass for small packed batches, where launching ~8 kernels per layer
from Python costs more than the GPU spends running them.

A batch of T tokens in n sequences replays the graph of the smallest bucket that holds it (at least T tokens,
at least n sequences). Its inputs are staged to the graph's own input buffer in one copy: token ids and
positions padded with zeros, cu_seqlens padded with empty sequences (worker/encoder_inputs.py). The padding
rows belong to no sequence: attention leaves them unwritten and every other op is row by row, so whatever
they hold never reaches a real row, and pooling reads the real rows only. The attention grid covers
max_model_len rows of each sequence (programs past a sequence's end return at once), so one graph serves any
mix of lengths. Graphs are captured the first time their bucket is needed and share one memory pool (they
replay one after another, each one's output read before the next replays: all on one stream).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Callable, TypeVar

import torch

from fasterllm.layers.varlen_attention import VarlenBatch
from fasterllm.models.bert import BertModel
from fasterllm.worker.encoder_inputs import split_staged, stage_packed_inputs

# token buckets: powers of two and the halfway points between them, so a batch pads by at most a half; past
# the largest a batch runs eagerly (the GPU's work then outlasts launching it from Python)
TOKEN_BUCKETS = (128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)
MIN_SEQ_BUCKET = 8
T = TypeVar("T")


def fits_a_bucket(num_tokens: int) -> bool:
    return num_tokens <= TOKEN_BUCKETS[-1]


def bucket(num_tokens: int, num_seqs: int) -> tuple[int, int]:
    """The (token, sequence) capacities of the graph a packed batch replays (num_tokens <= TOKEN_BUCKETS[-1])."""
    return (TOKEN_BUCKETS[bisect.bisect_left(TOKEN_BUCKETS, num_tokens)],
            max(MIN_SEQ_BUCKET, 1 << (num_seqs - 1).bit_length()))


@dataclass
class _CapturedForward:
    graph: torch.cuda.CUDAGraph
    inputs: torch.Tensor  # the graph reads its token ids, positions and cu_seqlens from here
    hidden: torch.Tensor  # [token bucket, hidden]: the graph writes the last hidden states here
    cu_seqlens: torch.Tensor


class EncoderGraphs:
    def __init__(self, model: BertModel, device: torch.device, max_seqlen: int):
        self.model = model
        self.device = device
        self.max_seqlen = max_seqlen
        self.captured: dict[tuple[int, int], _CapturedForward] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def forward(self, token_ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay the bucket's graph on these sequences -> (hidden states of the real tokens, cu_seqlens); both
        are views of the graph's buffers, valid until the next replay (read them on the same stream first)."""
        num_tokens = sum(map(len, token_ids))
        key = bucket(num_tokens, len(token_ids))
        captured = self.captured.get(key) or self._capture(*key)
        captured.inputs.copy_(stage_packed_inputs(token_ids, key[0], key[1], pin=True), non_blocking=True)
        captured.graph.replay()
        return captured.hidden[:num_tokens], captured.cu_seqlens[:len(token_ids) + 1]

    def _capture(self, token_capacity: int, seq_capacity: int) -> _CapturedForward:
        graph, inputs, hidden = capture_pass(self.model, token_capacity, seq_capacity, self.device,
                                            self.max_seqlen, self.pool)
        captured = _CapturedForward(graph, inputs, hidden, split_staged(inputs, token_capacity)[2])
        self.captured[(token_capacity, seq_capacity)] = captured
        return captured


def capture_pass(forward: Callable[[torch.Tensor, torch.Tensor, VarlenBatch], T], token_capacity: int,
                 seq_capacity: int, device: torch.device, max_seqlen: int, pool: tuple[int, int]
                 ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, T]:
    """A CUDA graph of forward(token ids, positions, batch) over a bucket's staged inputs, in pool -> (the graph,
    its input buffer as stage_packed_inputs lays it out, forward's output)."""
    inputs = torch.zeros(2 * token_capacity + seq_capacity + 1, dtype=torch.int32, device=device)
    token_ids, positions, cu_seqlens = split_staged(inputs, token_capacity)
    batch = VarlenBatch(cu_seqlens, max_seqlen, runs=[])
    forward(token_ids, positions, batch)  # compiles the Triton kernels and lets cuBLAS pick, before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    # thread_local: the server's generating engine may launch work from its own thread meanwhile
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        output = forward(token_ids, positions, batch)
    return graph, inputs, output
