"""The device side of embeddings: pack a batch of token-id lists, run the encoder, pool."""
from __future__ import annotations

import time
from itertools import chain

import numpy as np
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
        """One packed forward pass over these sequences -> pooled vectors [num_seqs, hidden], fp32, left on the
        model's device: nothing here waits for the device, so the host can stage the next batch meanwhile."""
        lengths = [len(ids) for ids in token_ids]
        flat_ids, positions, cu_seqlens = self._stage_inputs(token_ids, lengths)
        batch = VarlenBatch.from_lengths(lengths, self.device, cu_seqlens)
        hidden = self.model(flat_ids, positions, batch)
        return pool(hidden, batch.cu_seqlens, self.pooling)

    def _stage_inputs(self, token_ids: list[list[int]], lengths: list[int]
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Token ids, each token's position in its sequence, and cu_seqlens, built on the host and sent in one
        copy (from pinned memory on a GPU, without waiting)."""
        seq_lens = np.asarray(lengths, dtype=np.int32)
        total, count = int(seq_lens.sum()), len(lengths)
        host = torch.empty(2 * total + count + 1, dtype=torch.int32, pin_memory=self.device.type == "cuda")
        staged = host.numpy()
        staged[:total] = np.fromiter(chain.from_iterable(token_ids), dtype=np.int32, count=total)
        cu_seqlens = staged[2 * total:]
        cu_seqlens[0] = 0
        np.cumsum(seq_lens, out=cu_seqlens[1:])
        staged[total:2 * total] = np.arange(total, dtype=np.int32) - np.repeat(cu_seqlens[:-1], seq_lens)
        device_copy = host.to(self.device, non_blocking=True)
        return device_copy[:total], device_copy[total:2 * total], device_copy[2 * total:]
