"""Checkpoints for embeddings: which kind of model a checkpoint holds (a decoder or a BERT-family encoder), an
encoder's config.json + safetensors + tokenizer, and the sentence-transformers modules (modules.json,
1_Pooling/config.json, Normalize, sentence_bert_config.json) that say how to pool."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from fasterllm.config import BertConfig, PoolingConfig
from fasterllm.loader.hf_checkpoint import iter_safetensors, read_json
from fasterllm.loader.model_source import ModelSource, resolve_model
from fasterllm.loader.tokenizer import TokenizerWrapper, load_hf_tokenizer

_ST_POOLING_KEYS = {  # sentence-transformers' Pooling config flag -> our mode, in its order of precedence
    "pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean", "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len", "pooling_mode_lasttoken": "last",
}
# without sentence-transformers modules: the first token, normalised (vLLM's default for BERT embeddings)
DEFAULT_POOLING = PoolingConfig("cls", normalize=True)
DECODER_POOLING = PoolingConfig("last", normalize=True)  # vLLM's default for a decoder used as an embedder


@dataclass
class EncoderCheckpoint:
    source: ModelSource
    config: BertConfig
    tokenizer: TokenizerWrapper
    pooling: PoolingConfig
    max_seq_length: int  # the longest input the model was trained for (sentence-transformers' max_seq_length)
    weights: Callable[[], Iterator[tuple[str, torch.Tensor]]]


def is_decoder(source: ModelSource) -> bool:
    """A GGUF file (we read only decoders from GGUF) or a directory whose config names a *ForCausalLM."""
    if source.format == "gguf":
        return True
    architectures = read_json(source.path / "config.json").get("architectures") or []
    return any(name.endswith("ForCausalLM") for name in architectures)


def decoder_pooling(source: ModelSource) -> PoolingConfig:
    """What the checkpoint's sentence-transformers modules ask for; without them, vLLM's default for decoder
    embedders: the last token's final-norm state, L2-normalised."""
    if source.format == "hf" and (source.path / "modules.json").is_file():
        return read_pooling(source.path)
    return DECODER_POOLING


def open_encoder_checkpoint(model: str | None, tokenizer: str | None = None) -> EncoderCheckpoint:
    source = resolve_model(model, task="embed")
    if source.format != "hf":
        raise ValueError(f"Model {source.name!r} is a {source.format} file; embeddings need a Hugging Face "
                         "encoder directory (config.json, *.safetensors, tokenizer.json)")
    config = BertConfig.from_hf(read_json(source.path / "config.json"))
    tok_dir = source.path if tokenizer is None else resolve_model(tokenizer).path
    max_len = config.max_seq_len
    st_config = source.path / "sentence_bert_config.json"
    if st_config.is_file():
        max_len = min(max_len, read_json(st_config).get("max_seq_length") or max_len)
    return EncoderCheckpoint(source, config, load_hf_tokenizer(Path(tok_dir), []), read_pooling(source.path),
                             max_len, lambda: iter_safetensors(source.path))


def read_pooling(model_dir: Path) -> PoolingConfig:
    """The pooling sentence-transformers would apply: its Pooling module's mode, and whether Normalize follows."""
    modules_file = model_dir / "modules.json"
    if not modules_file.is_file():
        return DEFAULT_POOLING
    modules = read_json(modules_file)
    pooling = next((m for m in modules if m.get("type", "").endswith(".Pooling")), None)
    normalize = any(m.get("type", "").endswith(".Normalize") for m in modules)
    if pooling is None:
        return PoolingConfig(DEFAULT_POOLING.mode, normalize)
    pooling_file = model_dir / pooling.get("path", "") / "config.json"
    raw = read_json(pooling_file) if pooling_file.is_file() else {}
    if "pooling_mode" in raw:  # newer sentence-transformers write the mode by name
        mode = {"mean_tokens": "mean", "cls_token": "cls", "max_tokens": "max", "lasttoken": "last",
                "mean_sqrt_len_tokens": "mean_sqrt_len"}.get(raw["pooling_mode"], raw["pooling_mode"])
        return PoolingConfig(mode, normalize)
    chosen = [mode for key, mode in _ST_POOLING_KEYS.items() if raw.get(key)]
    if len(chosen) != 1:
        raise ValueError(f"{pooling_file} asks for pooling modes {chosen or 'none'}; fasterllm supports exactly one "
                         f"of {', '.join(_ST_POOLING_KEYS)} set to true")
    return PoolingConfig(chosen[0], normalize)
