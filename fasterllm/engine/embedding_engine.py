"""EmbeddingEngine: prompts -> one vector each, batched by a token budget rather than by count.

Every prompt is tokenized and checked before any runs (one bad prompt names itself and runs nothing).
Prompts are then sorted by length and cut into batches of at most max_num_batched_tokens real tokens:
packed batches cost what their tokens cost, and equal lengths side by side let attention run a whole
run of sequences in one call (layers/varlen_attention.py). Vectors come back in input order.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from fasterllm.config import EngineArgs
from fasterllm.engine.input_processor import InputProcessor
from fasterllm.engine.limits import resolve_max_model_len
from fasterllm.loader.checkpoint import open_checkpoint
from fasterllm.loader.encoder_checkpoint import decoder_pooling, is_decoder, open_encoder_checkpoint
from fasterllm.loader.model_source import resolve_model
from fasterllm.worker.decoder_embedding_runner import DecoderEmbeddingRunner
from fasterllm.worker.encoder_runner import EncoderRunner

logger = logging.getLogger("fasterllm")


class EmbeddingEngine:
    def __init__(self, args: EngineArgs):
        start = time.perf_counter()
        args.validate()
        self.args = args
        # the model's architecture picks the path: a decoder (LLaMA family) or a BERT-family encoder
        source = resolve_model(args.model, task="embed")
        decoder = is_decoder(source)
        if not decoder:
            _refuse_encoder_weight_options(args, source.name)
        checkpoint = (open_checkpoint if decoder else open_encoder_checkpoint)(args.model, args.tokenizer)
        self.device = args.resolve_device()
        self.dtype = args.resolve_dtype(self.device)
        self.source = checkpoint.source
        self.model_name = checkpoint.source.name
        self.model_config = checkpoint.config
        self.tokenizer = checkpoint.tokenizer
        self.embedding_dim = checkpoint.config.hidden_size
        self.max_num_batched_tokens = args.max_num_batched_tokens or (32768 if self.device.type == "cuda" else 8192)
        if decoder:
            self.pooling = decoder_pooling(checkpoint.source)
            # a prompt attends to all of itself here (no cache, no chunks): a sliding window bounds its length too
            limit = min(checkpoint.config.max_position_embeddings, checkpoint.config.sliding_window or 1 << 62)
            default_len = min(limit, self.max_num_batched_tokens)
        else:
            self.pooling = checkpoint.pooling
            limit, default_len = checkpoint.config.max_seq_len, checkpoint.max_seq_length
        self.max_model_len = resolve_max_model_len(args.max_model_len, default_len, limit, f"{limit} positions")
        self.inputs = InputProcessor(self.tokenizer, self.model_config.vocab_size, self.max_model_len)
        if self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} is below max_model_len="
                             f"{self.max_model_len}: a longest input would not fit a batch; raise it or lower "
                             "max_model_len")
        self.runner = (DecoderEmbeddingRunner(checkpoint, self.pooling, self.device, self.dtype, self.max_model_len,
                                              args.load_format, args.quantization)
                       if decoder else
                       EncoderRunner(checkpoint, self.device, self.dtype, self.max_model_len, args.enforce_eager))
        logger.info("embedding engine ready in %.1fs: %s (%s pooling%s), %s on %s, max_model_len %d",
                    time.perf_counter() - start, self.model_name, self.pooling.mode,
                    ", normalised" if self.pooling.normalize else "", str(self.dtype).removeprefix("torch."),
                    self.device, self.max_model_len)

    def tokenize(self, prompts: list[str | list[int]], truncate_prompt_tokens: int | None = None) -> list[list[int]]:
        """Token ids of every prompt, checked (input_processor.py); an error names the prompt's index."""
        return self.inputs.embedding_inputs(prompts, truncate_prompt_tokens)

    def embed(self, token_ids: list[list[int]], on_batch: Callable[[int], None] | None = None) -> torch.Tensor:
        """[len(token_ids), embedding_dim] fp32 on the CPU, row i for token_ids[i]."""
        if not token_ids:
            raise ValueError("no inputs to embed; pass at least one")
        order = sorted(range(len(token_ids)), key=lambda i: len(token_ids[i]))
        pooled = []  # stays on the device until every batch is queued: one wait and one copy at the end
        for batch in self._token_budget_batches(order, token_ids):
            pooled.append(self.runner.embed([token_ids[i] for i in batch]))
            if on_batch is not None:
                on_batch(len(batch))
        result = torch.empty(len(token_ids), self.embedding_dim)
        result[torch.tensor(order)] = torch.cat(pooled).cpu()
        return result

    def _token_budget_batches(self, order: list[int], token_ids: list[list[int]]) -> list[list[int]]:
        batches: list[list[int]] = [[]]
        used = 0
        for index in order:
            length = len(token_ids[index])
            if batches[-1] and used + length > self.max_num_batched_tokens:
                batches.append([])
                used = 0
            batches[-1].append(index)
            used += length
        return batches



def _refuse_encoder_weight_options(args: EngineArgs, model_name: str) -> None:
    """The encoder path loads float weights as stored: a quantization or dummy weights asked of it would be ignored."""
    if args.quantization is not None:
        raise ValueError(f"quantization={args.quantization!r} is not supported for {model_name}: BERT-family encoders "
                         "run unquantized; leave quantization out (quantized embeddings need a LLaMA-family decoder: "
                         "a .gguf file or a *ForCausalLM directory)")
    if args.load_format != "auto":
        raise ValueError(f"load_format={args.load_format!r} is not supported for {model_name}: BERT-family encoders "
                         "always load their checkpoint's weights; leave load_format out, or for random weights use "
                         "`fasterllm bench-embed --random-encoder`")
