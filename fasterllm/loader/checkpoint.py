"""Open any supported checkpoint: its model config, its tokenizer, and a stream of its weights."""
from __future__ import annotations

from collections.abc import Callable, Iterator
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fasterllm.config import PREQUANTIZED_METHODS, ModelConfig
from fasterllm.layers.quantization.gguf import BlockLayout
from fasterllm.loader.gguf_checkpoint import GGUFFile
from fasterllm.loader.prequantized import StoredQuantization, stored_quantization
from fasterllm.loader.hf_checkpoint import iter_safetensors, load_hf_config
from fasterllm.loader.kv_cache_scales import kv_cache_scales_of, without_kv_cache_scales
from fasterllm.loader.model_source import ModelSource, resolve_model
from fasterllm.loader.tokenizer import (
    TokenizerWrapper,
    load_gguf_tokenizer,
    load_hf_tokenizer,
)
from fasterllm.loader.weight_parts import WeightSource
from fasterllm.seq2seq_config import Seq2SeqConfig, T5Config

logger = logging.getLogger("fasterllm")


@dataclass
class Checkpoint:
    source: ModelSource
    config: ModelConfig | Seq2SeqConfig | T5Config
    tokenizer: TokenizerWrapper
    weights: Callable[[], Iterator[tuple[str, torch.Tensor]]]  # Hugging Face names
    # the same stream as WeightSources that read only the part asked for (safetensors slices; a GGUF's tensors)
    weight_parts: Callable[[], Iterator[tuple[str, WeightSource]]]
    # a GGUF with projections stored in blocks that run as stored (Q4_0 / Q4_1 / Q4_K / Q5_K / Q6_K / Q8_0): the same
    # stream with those kept as blocks (quantization='gguf'), and which projections they are ("layers.3.qkv_proj")
    # with the layout each runs as
    native_block_weights: Callable[[], Iterator[tuple[str, torch.Tensor]]] | None = None
    native_block_layouts: dict[str, BlockLayout] = field(default_factory=dict)
    # GGUF type -> how many projections (or the head) have a part in it, which quantization='gguf' cannot run as stored
    types_not_run_as_stored: dict[str, int] = field(default_factory=dict)
    # how its weights are stored, when pre-quantized (loader/prequantized.py: its method, one of PREQUANTIZED_METHODS;
    # its layout, the layer its codes run as; its name for messages): `weights` then yields its projections' codes
    # and scales. None: float
    stored: StoredQuantization | None = None
    # (k_scale, v_scale) of each layer for an fp8 KV cache, when the checkpoint carries them (loader/kv_cache_scales.py;
    # its weight streams then leave them out); None: it carries none
    kv_cache_scales: list[tuple[float, float]] | None = None

    @property
    def eos_token_ids(self) -> list[int]:
        """The ids that end generation: the tokenizer's, else the model config's."""
        return self.tokenizer.eos_token_ids or self.config.eos_token_ids

    @property
    def stored_layout(self) -> str | None:
        return None if self.stored is None else self.stored.layout

    def resolve_quantization(self, requested: str | None) -> str | None:
        """The method the model runs with: a pre-quantized checkpoint's own (asked for by name, or not at all), else
        the one requested."""
        if self.stored is None:
            if requested in PREQUANTIZED_METHODS:
                raise ValueError(f"quantization={requested!r} runs a {requested.upper()} checkpoint's codes as stored, "
                                 f"but {self.source.path} is not one; use quantization='int4' (or 'int8') to quantize "
                                 "it at load instead")
            return requested
        if requested not in (None, self.stored.method):
            raise ValueError(f"{self.source.path} is a {self.stored.name} checkpoint, which runs as stored; "
                             f"quantization={requested!r} cannot apply to it: leave quantization unset")
        return self.stored.method

    def require_native_block_weights(self) -> Callable[[], Iterator[tuple[str, torch.Tensor]]]:
        if self.native_block_weights is None:
            kind = ("GGUF file with no projection in Q4_0/Q4_1/Q4_K/Q5_K/Q6_K/Q8_0 blocks"
                    if self.source.format == "gguf" else f"{self.source.format} checkpoint, not a GGUF file")
            raise ValueError(f"quantization='gguf' runs Q4_0/Q4_1/Q4_K/Q5_K/Q6_K/Q8_0 GGUF blocks as stored, but "
                             f"{self.source.path} is a {kind}; use quantization='int4' (or 'int8') to quantize it at "
                             "load instead")
        if self.types_not_run_as_stored:
            counts = ", ".join(f"{count} in {name}" for name, count in sorted(self.types_not_run_as_stored.items()))
            logger.warning("quantization='gguf': %s has projections stored in types that do not run as stored (%s); "
                           "they are dequantized and re-quantized to int8 at load. Only Q4_0/Q4_1/Q4_K/Q5_K/Q6_K/Q8_0 "
                           "run as stored: re-quantize the file to one of them (llama.cpp's llama-quantize) to run it "
                           "without re-rounding", self.source.path.name, counts)
        return self.native_block_weights


def open_checkpoint(model: str | None, tokenizer: str | None = None) -> Checkpoint:
    source = resolve_model(model)
    if source.format == "gguf":
        gguf_file = GGUFFile(source.path)
        config = gguf_file.model_config()
        tok = (load_gguf_tokenizer(gguf_file.metadata, config.eos_token_ids) if tokenizer is None
               else load_hf_tokenizer(resolve_model(tokenizer).path, config.eos_token_ids))
        layouts = gguf_file.native_projections()
        blocks = (lambda: gguf_file.iter_weights(keep_native_blocks=True)) if layouts else None
        return Checkpoint(source, config, tok, gguf_file.iter_weights, gguf_file.iter_weights, blocks, layouts,
                          gguf_file.types_not_run_as_stored())
    config = load_hf_config(source.path)  # an unsupported architecture is the first thing it reports
    tok_dir = source.path if tokenizer is None else Path(resolve_model(tokenizer).path)
    tok = load_hf_tokenizer(tok_dir, config.eos_token_ids)
    model_dir = Path(source.path)
    quantized = stored_quantization(model_dir)
    kv_scales = kv_cache_scales_of(model_dir, config)
    # declared KV-cache scales go to the attention layers, not to parameters (undeclared ones reach the model's loader,
    # which names them)
    stream = without_kv_cache_scales if kv_scales is not None else (lambda weights: weights)
    if quantized is not None:
        weights = lambda: stream(quantized.weights(model_dir))  # noqa: E731
        return Checkpoint(source, config, tok, weights, _no_parts, stored=quantized, kv_cache_scales=kv_scales)
    return Checkpoint(source, config, tok, lambda: stream(iter_safetensors(model_dir)),
                      lambda: stream(iter_safetensors(model_dir, lazy=True)), kv_cache_scales=kv_scales)


def _no_parts():
    raise ValueError("a GPTQ, AWQ or compressed-tensors checkpoint runs on one device: tensor parallelism does not "
                     "shard its stored codes yet")
