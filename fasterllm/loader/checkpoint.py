"""Open any supported checkpoint: its model config, its tokenizer, and a stream of its weights."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from fasterllm.config import ModelConfig
from fasterllm.loader.gguf_checkpoint import GGUFFile
from fasterllm.loader.hf_checkpoint import iter_safetensors, load_hf_config
from fasterllm.loader.model_source import ModelSource, resolve_model
from fasterllm.models.registry import model_class
from fasterllm.loader.tokenizer import TokenizerWrapper, load_gguf_tokenizer, load_hf_tokenizer


@dataclass
class Checkpoint:
    source: ModelSource
    config: ModelConfig
    tokenizer: TokenizerWrapper
    weights: Callable[[], Iterator[tuple[str, torch.Tensor]]]  # Hugging Face names


def open_checkpoint(model: str | None, tokenizer: str | None = None) -> Checkpoint:
    source = resolve_model(model)
    if source.format == "gguf":
        gguf_file = GGUFFile(source.path)
        config = gguf_file.model_config()
        tok = (load_gguf_tokenizer(gguf_file.metadata, config.eos_token_ids) if tokenizer is None
               else load_hf_tokenizer(resolve_model(tokenizer).path, config.eos_token_ids))
        return Checkpoint(source, config, tok, gguf_file.iter_weights)
    config = load_hf_config(source.path)
    model_class(config.architecture)  # an unsupported architecture is the first thing to report
    tok_dir = source.path if tokenizer is None else Path(resolve_model(tokenizer).path)
    return Checkpoint(source, config, load_hf_tokenizer(tok_dir, config.eos_token_ids),
                      lambda: iter_safetensors(source.path))
