"""Embeddings from a decoder (LLaMA family): one causal forward pass over a packed batch of whole prompts, no KV
cache (nothing is decoded after it), then the pooling (by default the last token's final-norm state, normalised).

Attention takes the torch path on every device: each prompt is a prefill group attending to its own new K/V.
"""
from __future__ import annotations

import time
from itertools import accumulate

import torch

from fasterllm.layers.attention import AttentionMetadata, PrefillGroup
from fasterllm.config import PoolingConfig
from fasterllm.layers.pooling import pool
from fasterllm.loader.checkpoint import Checkpoint
from fasterllm.worker.encoder_inputs import packed_inputs_on
from fasterllm.worker.decoder_builder import build_decoder


class DecoderEmbeddingRunner:
    def __init__(self, checkpoint: Checkpoint, pooling: PoolingConfig, device: torch.device, dtype: torch.dtype,
                 max_model_len: int, load_format: str = "auto", quantization: str | None = None):
        start = time.perf_counter()
        self.device = device
        self.pooling = pooling
        self.model = build_decoder(checkpoint, max_model_len, device, dtype, load_format, quantization,
                                   with_head=False).eval()
        self.load_seconds = time.perf_counter() - start

    @torch.inference_mode()
    def embed(self, token_ids: list[list[int]]) -> torch.Tensor:
        """One packed forward pass over these sequences -> pooled vectors [num_seqs, hidden], fp32, left on the
        model's device."""
        lengths = [len(ids) for ids in token_ids]
        total = sum(lengths)
        ids, positions, cu_seqlens = packed_inputs_on(token_ids, self.device)
        groups = [PrefillGroup(end - length, end, None, None) for length, end in zip(lengths, accumulate(lengths))]
        # slot -1 everywhere: no token is stored (the model gets no cache)
        meta = AttentionMetadata(positions, torch.full((total,), -1, device=self.device), total, groups, None)
        return pool(self.model.hidden_states(ids, positions, None, meta), cu_seqlens, self.pooling)
