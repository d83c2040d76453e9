"""The device side of embeddings: pack a batch of token-id lists, run the encoder (eager, or a CUDA graph's
replay for small batches on a GPU), pool."""
from __future__ import annotations

import time

import torch

from fasterllm.layers.pooling import pool
from fasterllm.layers.varlen_attention import VarlenBatch
from fasterllm.loader.encoder_checkpoint import EncoderCheckpoint
from fasterllm.models.bert import BertModel
from fasterllm.worker.encoder_graphs import EncoderGraphs, fits_a_bucket
from fasterllm.worker.encoder_inputs import packed_inputs_on


class EncoderRunner:
    def __init__(self, checkpoint: EncoderCheckpoint, device: torch.device, dtype: torch.dtype, max_model_len: int,
                 enforce_eager: bool = False):
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
        use_graphs = device.type == "cuda" and not enforce_eager
        self.graphs = EncoderGraphs(self.model, device, max_model_len) if use_graphs else None
        self.load_seconds = time.perf_counter() - start

    @torch.inference_mode()
    def embed(self, token_ids: list[list[int]]) -> torch.Tensor:
        """One packed forward pass over these sequences -> pooled vectors [num_seqs, hidden], fp32, left on the
        model's device: nothing here waits for the device, so the host can stage the next batch meanwhile."""
        if self.graphs is not None and fits_a_bucket(sum(map(len, token_ids))):
            hidden, cu_seqlens = self.graphs.forward(token_ids)
        else:
            hidden, cu_seqlens = self._eager_forward(token_ids)
        return pool(hidden, cu_seqlens, self.pooling)

    def _eager_forward(self, token_ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        ids, positions, cu_seqlens = packed_inputs_on(token_ids, self.device)
        batch = VarlenBatch.from_lengths([len(t) for t in token_ids], self.device, cu_seqlens)
        return self.model(ids, positions, batch), cu_seqlens
