"""GGUF files: metadata -> ModelConfig, tensors -> Hugging Face names, dequantized to float."""
from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fasterllm.config import ModelConfig
from fasterllm.loader.gguf_blocks import Q4_TYPES, dequantize_q4_blocks, unpack_q4_blocks

# GGUF architecture -> (our model class name, whether llama.cpp permuted Q/K rows for interleaved RoPE)
GGUF_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", True),
    "mistral": ("MistralForCausalLM", True),
    "qwen2": ("Qwen2ForCausalLM", False),
    "qwen3": ("Qwen3ForCausalLM", False),
}

_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# our fused projections and the GGUF tensors each is made of
_PROJECTION_PARTS = {"qkv_proj": ("attn_q", "attn_k", "attn_v"), "o_proj": ("attn_output",),
                     "gate_up_proj": ("ffn_gate", "ffn_up"), "down_proj": ("ffn_down",)}
_LAYER_TENSOR_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


@functools.lru_cache(maxsize=4)
def _read_gguf(path: str, size: int, mtime_ns: int) -> tuple[Any, dict[str, Any]]:
    """The file's reader (tensors memory-mapped) and metadata. Parsed once per file version and process: gguf's
    reader takes seconds over a tokenizer's ~100k metadata strings, and a server or a test session opens the
    same file for several engines."""
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except Exception as exc:  # the reader raises many kinds of errors on bad bytes
        raise ValueError(f"{path} is not a readable GGUF file ({type(exc).__name__}: {exc}); "
                         "the file is corrupt or truncated: download it again") from exc
    metadata = {key: value.contents() for key, value in reader.fields.items() if not key.startswith("GGUF.")}
    return reader, metadata


class GGUFFile:
    """An opened GGUF file; tensors are memory-mapped until dequantized."""

    def __init__(self, path: Path):
        self.path = path
        stat = path.stat()
        self.reader, self.metadata = _read_gguf(str(path), stat.st_size, stat.st_mtime_ns)
        self.arch = self.metadata.get("general.architecture")
        if self.arch not in GGUF_ARCHITECTURES:
            raise ValueError(f"GGUF architecture {self.arch!r} in {path.name} is not supported; "
                             f"supported: {', '.join(sorted(GGUF_ARCHITECTURES))}")

    def required(self, key: str) -> Any:
        if key not in self.metadata:
            raise ValueError(f"GGUF file {self.path.name} lacks the metadata key {key!r}; the file is incomplete "
                             "or was not written by a llama.cpp-compatible converter")
        return self.metadata[key]

    def model_config(self) -> ModelConfig:
        meta, arch, required = self.metadata, self.arch, self.required
        names = {t.name for t in self.reader.tensors}
        num_heads = required(f"{arch}.attention.head_count")
        hidden = required(f"{arch}.embedding_length")
        head_dim = meta.get(f"{arch}.attention.key_length", hidden // num_heads)
        vocab = meta.get(f"{arch}.vocab_size", len(meta.get("tokenizer.ggml.tokens", [])))
        eos = meta.get("tokenizer.ggml.eos_token_id")
        rope_freqs = None
        if "rope_freqs.weight" in names:
            rope_freqs = torch.from_numpy(self._dequantize(self._tensor("rope_freqs.weight")).copy()).reshape(-1)
        scaling = None
        if meta.get(f"{arch}.rope.scaling.type") == "linear":
            scaling = {"rope_type": "linear", "factor": meta[f"{arch}.rope.scaling.factor"]}
        return ModelConfig(
            architecture=GGUF_ARCHITECTURES[arch][0],
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=required(f"{arch}.feed_forward_length"),
            num_hidden_layers=required(f"{arch}.block_count"),
            num_attention_heads=num_heads,
            num_key_value_heads=meta.get(f"{arch}.attention.head_count_kv", num_heads),
            head_dim=head_dim,
            rms_norm_eps=meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
            rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            max_position_embeddings=meta.get(f"{arch}.context_length", 2048),
            tie_word_embeddings="output.weight" not in names,
            attention_bias="blk.0.attn_q.bias" in names,
            o_proj_bias="blk.0.attn_output.bias" in names,
            qk_norm="blk.0.attn_q_norm.weight" in names,
            sliding_window=meta.get(f"{arch}.attention.sliding_window"),
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=[] if eos is None else [eos],
            rope_freq_factors=rope_freqs,
        )

    @functools.cached_property
    def _q4_groups(self) -> dict[str, tuple[str, ...]]:
        """Our decoder-layer projection ("layers.3.qkv_proj") -> its GGUF tensors, for those whose every part is
        stored as 4-bit blocks (Q4_0 / Q4_1 / Q4_K). A Q4_K_M file keeps some attn_v and ffn_down tensors in Q6_K;
        the projections holding them do not qualify."""
        types = {t.name: t.tensor_type.name for t in self.reader.tensors}
        layers = {int(name.split(".")[1]) for name in types if name.startswith("blk.")}
        groups = {}
        for i in sorted(layers):
            for projection, parts in _PROJECTION_PARTS.items():
                names = tuple(f"blk.{i}.{part}.weight" for part in parts)
                if all(types.get(name) in Q4_TYPES for name in names):
                    groups[f"layers.{i}.{projection}"] = names
        return groups

    def q4_projections(self) -> frozenset[str]:
        """The projections that run as the file stores them (quantization='gguf')."""
        return frozenset(self._q4_groups)

    def iter_weights(self, keep_q4_blocks: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, float32 tensor) for every weight, with llama.cpp's Q/K permutation undone.
        keep_q4_blocks: a part of one of q4_projections() comes as three row-indexed tensors instead, <module>.qcodes,
        .qscales and .qmins (loader/gguf_blocks.py)."""
        kept = {name for names in self._q4_groups.values() for name in names} if keep_q4_blocks else set()
        cfg_heads = self.required(f"{self.arch}.attention.head_count")
        kv_heads = self.metadata.get(f"{self.arch}.attention.head_count_kv", cfg_heads)
        permuted = GGUF_ARCHITECTURES[self.arch][1]
        for tensor in self.reader.tensors:
            if tensor.name == "rope_freqs.weight":
                continue  # folded into the rotary embedding by model_config()
            name = _hf_name(tensor.name)
            if tensor.name in kept:
                shape = tuple(int(d) for d in reversed(tensor.shape))
                parts = unpack_q4_blocks(tensor.data, tensor.tensor_type.name, shape)
                named = [(name.replace(".weight", suffix), part)
                         for suffix, part in zip((".qcodes", ".qscales", ".qmins"), parts)]
            elif tensor.tensor_type.name in Q4_TYPES:
                shape = tuple(int(d) for d in reversed(tensor.shape))
                named = [(name, dequantize_q4_blocks(tensor.data, tensor.tensor_type.name, shape))]
            else:
                named = [(name, torch.from_numpy(self._dequantize(tensor).copy()))]
            for part_name, weight in named:  # every row-indexed part is permuted alike
                if permuted and ".self_attn.q_proj." in part_name:
                    weight = _unpermute_rows(weight, cfg_heads)
                elif permuted and ".self_attn.k_proj." in part_name:
                    weight = _unpermute_rows(weight, kv_heads)
                yield part_name, weight

    def _tensor(self, name: str):
        return next(t for t in self.reader.tensors if t.name == name)

    def _dequantize(self, tensor) -> np.ndarray:
        from gguf import quants

        try:
            values = quants.dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError as exc:
            raise ValueError(f"GGUF tensor {tensor.name!r} in {self.path.name} has type {tensor.tensor_type.name}, "
                             "which this gguf package cannot dequantize; convert the file to F16, Q8_0, Q4_0, "
                             "Q4_1 or Q4_K (llama.cpp's llama-quantize)") from exc
        # GGUF lists dimensions innermost first; torch wants them outermost first
        return values.reshape(tuple(int(d) for d in reversed(tensor.shape))).astype(np.float32, copy=False)


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _TENSOR_NAMES:
        return _TENSOR_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _LAYER_TENSOR_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_TENSOR_NAMES[parts[2]]}.{parts[3]}"
    raise ValueError(f"GGUF tensor {gguf_name!r} is not part of a supported LLaMA-family model")


def _unpermute_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's convert-time row order (pairs interleaved per head) back to Hugging Face's halves."""
    rows = weight.shape[0]
    head_dim = rows // num_heads
    return (weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
            .transpose(1, 2).reshape(weight.shape))
