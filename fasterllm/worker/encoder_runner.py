"""The device side of embeddings: pack a batch of token-id lists, run the encoder, pool."""
from __future__ import annotations

import time
from itertools import chain

import torch

from fasterllm.layers.pooling import pool
from fasterllm.layers.varlen_attention import VarlenBatch
from fasterllm.loader.encoder_checkpoint import EncoderCheckpoint
from fasterllm.models.bert import BertModel


class EncoderRunner:
    def __init__(self, checkpoint: EncoderCheckpoint, device: torch.device, dtype: torch.dtype):
        start = time.perf_counter()
        self.device = device
        self.pooling = checkpoint.pooling
        with torch.device("meta"):  # no random init and no fp32 copy: load_weights fills every tensor
            model = BertModel(checkpoint.config)
        model = model.to(dtype).to_empty(device=device).requires_grad_(False)
        model.load_weights(checkpoint.weights())
        if device.type == "cpu":
            model.pack_for_cpu()
        self.model = model.eval()
        self.load_seconds = time.perf_counter() - start

    @torch.inference_mode()
    def embed(self, token_ids: list[list[int]]) -> torch.Tensor:
        """One packed forward pass over these sequences -> pooled vectors [num_seqs, hidden], fp32 on the CPU."""
        lengths = [len(ids) for ids in token_ids]
        batch = VarlenBatch.from_lengths(lengths, self.device)
        flat_ids = torch.tensor(list(chain.from_iterable(token_ids)), dtype=torch.long).to(self.device)
        starts = batch.cu_seqlens[:-1].long()
        # position of each token within its own sequence
        positions = torch.arange(batch.num_tokens, device=self.device) - torch.repeat_interleave(
            starts, torch.tensor(lengths, device=self.device))
        hidden = self.model(flat_ids, positions, batch)
        return pool(hidden, batch.cu_seqlens, self.pooling).cpu()
