"""Embeddings from a decoder (LLaMA family): one causal forward pass over a packed batch of whole prompts, no KV
cache (nothing is decoded after it), then the pooling (by default the last token's final-norm state, normalised).

Attention takes the torch path on every device: each prompt is a prefill group attending to its own new K/V.
"""
from __future__ import annotations

import time
from itertools import accumulate

import torch

from fasterllm.layers.attention import AttentionMetadata, PrefillGroup
from fasterllm.layers.linear import can_pack
from fasterllm.layers.pooling import PoolingConfig, pool
from fasterllm.loader.checkpoint import Checkpoint
from fasterllm.models.registry import model_class
from fasterllm.worker.encoder_inputs import split_staged, stage_packed_inputs


class DecoderEmbeddingRunner:
    def __init__(self, checkpoint: Checkpoint, pooling: PoolingConfig, device: torch.device, dtype: torch.dtype,
                 max_model_len: int):
        start = time.perf_counter()
        self.device = device
        self.pooling = pooling
        config = checkpoint.config
        self.model = model_class(config.architecture)(config, max_model_len, device, dtype)
        self.model.load_weights(checkpoint.weights())
        if can_pack(device, dtype):
            self.model.pack_for_cpu()
        self.model.eval()
        self.load_seconds = time.perf_counter() - start

    @torch.inference_mode()
    def embed(self, token_ids: list[list[int]]) -> torch.Tensor:
        """One packed forward pass over these sequences -> pooled vectors [num_seqs, hidden], fp32, left on the
        model's device."""
        lengths = [len(ids) for ids in token_ids]
        total = sum(lengths)
        staged = stage_packed_inputs(token_ids, total, len(lengths), pin=self.device.type == "cuda")
        ids, positions, cu_seqlens = split_staged(staged.to(self.device, non_blocking=True), total)
        groups = [PrefillGroup(end - length, end, None, None) for length, end in zip(lengths, accumulate(lengths))]
        # slot -1 everywhere: no token is stored (the model gets no cache)
        meta = AttentionMetadata(positions, torch.full((total,), -1, device=self.device), total, groups, None)
        return pool(self.model.hidden_states(ids, positions, None, meta), cu_seqlens, self.pooling)
