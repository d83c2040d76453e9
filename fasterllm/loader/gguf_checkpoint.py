"""GGUF files: metadata -> ModelConfig, tensors -> Hugging Face names, dequantized to float (what each architecture's
converter did differently: loader/gguf_families.py)."""
from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fasterllm.config import ModelConfig
from fasterllm.layers.quantization.gguf import BlockLayout
from fasterllm.loader.gguf_blocks import NATIVE_GROUP_SIZES, block_layout, dequantize_blocks, unpack_blocks
from fasterllm.loader.gguf_families import EXPERT_NAMES, GGUF_FAMILIES, MERGED_EXPERTS, MIXTRAL

_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# our fused projections and the GGUF tensors each is made of (a family may store some fused already)
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
# llama.cpp's list of end-of-turn texts, less those that are also a plain end of text (<|endoftext|>)
_END_OF_TURN_TEXTS = ("<end_of_turn>", "<|end|>", "<|eot_id|>", "<|im_end|>")


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
        if self.arch not in GGUF_FAMILIES:
            raise ValueError(f"GGUF architecture {self.arch!r} in {path.name} is not supported; "
                             f"supported: {', '.join(sorted(GGUF_FAMILIES))}")
        self.family = GGUF_FAMILIES[self.arch]
        self._tensors = {t.name: t for t in self.reader.tensors}
        self._layer_names = {**_LAYER_TENSOR_NAMES, **self.family.layer_names, **EXPERT_NAMES}

    def required(self, key: str) -> Any:
        if key not in self.metadata:
            raise ValueError(f"GGUF file {self.path.name} lacks the metadata key {key!r}; the file is incomplete "
                             "or was not written by a llama.cpp-compatible converter")
        return self.metadata[key]

    def has_tensor(self, name: str) -> bool:
        return name in self._tensors

    def float_tensor(self, name: str) -> torch.Tensor:
        """A small tensor (RoPE factors), dequantized to fp32 and flattened."""
        return torch.from_numpy(self._dequantize(self._tensors[name]).copy()).reshape(-1)

    def rope_theta(self, default: float = 10000.0) -> float:
        return float(self.metadata.get(f"{self.arch}.rope.freq_base", default))

    def rope_scaling(self) -> dict[str, Any] | None:
        kind = self.metadata.get(f"{self.arch}.rope.scaling.type")
        if kind in (None, "none") or (kind == "longrope" and self.has_tensor("rope_factors_long.weight")):
            return None  # LongRoPE: its factor tensors, read by the family (Phi-3)
        if kind != "linear":
            raise ValueError(f"GGUF file {self.path.name} has RoPE scaling {kind!r}, which is not supported from GGUF; "
                             "supported: linear (and Phi-3's LongRoPE factors)")
        return {"rope_type": "linear", "factor": self.metadata[f"{self.arch}.rope.scaling.factor"]}

    def model_config(self) -> ModelConfig:
        meta, arch, required = self.metadata, self.arch, self.required
        num_heads = required(f"{arch}.attention.head_count")
        hidden = required(f"{arch}.embedding_length")
        head_dim = meta.get(f"{arch}.attention.key_length", hidden // num_heads)
        rotary = meta.get(f"{arch}.rope.dimension_count", head_dim)
        if rotary != head_dim:
            raise ValueError(f"GGUF file {self.path.name} rotates {rotary} of each head's {head_dim} dimensions; "
                             "partial rotary embeddings are not supported (every supported family rotates all)")
        vocab = meta.get(f"{arch}.vocab_size", len(meta.get("tokenizer.ggml.tokens", [])))
        # a chat model's end of turn (Gemma's <end_of_turn>, Phi-3's <|end|>) stops generation too, as in llama.cpp
        stops = [meta.get("tokenizer.ggml.eos_token_id"), self._end_of_turn_id()]
        kv_heads = meta.get(f"{arch}.attention.head_count_kv", num_heads)
        rope_freqs = self.float_tensor("rope_freqs.weight") if self.has_tensor("rope_freqs.weight") else None
        q_norm = self._tensors.get("blk.0.attn_q_norm.weight")
        fields = dict(
            architecture=self.family.architecture,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=required(f"{arch}.feed_forward_length"),
            num_hidden_layers=required(f"{arch}.block_count"),
            num_attention_heads=num_heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
            rope_theta=self.rope_theta(),
            rope_scaling=self.rope_scaling(),
            max_position_embeddings=meta.get(f"{arch}.context_length", 2048),
            tie_word_embeddings="output.weight" not in self._tensors,
            attention_bias="blk.0.attn_q.bias" in self._tensors,
            o_proj_bias="blk.0.attn_output.bias" in self._tensors,
            qk_norm=q_norm is not None,
            # OLMoE: one norm over all query heads (its weight as long as every head's row)
            qk_norm_over_heads=q_norm is not None and int(q_norm.shape[0]) == num_heads * head_dim != head_dim,
            sliding_window=meta.get(f"{arch}.attention.sliding_window"),
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=list(dict.fromkeys(t for t in stops if t is not None)),
            rope_freq_factors=rope_freqs,
        )
        if self.family.fields is not None:
            fields.update(self.family.fields(self))
        if any(name.endswith(".ffn_gate_exps.weight") for name in self._tensors):
            fields.update(self._expert_fields(fields["num_hidden_layers"]))
        return ModelConfig(**fields)

    def _end_of_turn_id(self) -> int | None:
        """The file's end-of-turn token or, where it names none, the one llama.cpp takes for it by its text: the
        converter leaves it out for some chat models (Gemma's <end_of_turn>, Phi-3's <|end|>)."""
        eot = self.metadata.get("tokenizer.ggml.eot_token_id")
        tokens = self.metadata.get("tokenizer.ggml.tokens", [])
        return eot if eot is not None else next((tokens.index(t) for t in _END_OF_TURN_TEXTS if t in tokens), None)

    def _expert_fields(self, layers: int) -> dict[str, Any]:
        """A mixture of experts: its sizes read off the merged expert tensors, which layers have them (the others a
        dense FFN), and its routing from the metadata."""
        meta, arch = self.metadata, self.arch
        gating = meta.get(f"{arch}.expert_gating_func")
        if gating not in (None, 1):  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
            raise ValueError(f"GGUF file {self.path.name} routes experts with gating function {gating}; only softmax "
                             "routing (1, every supported family's) is supported")
        expert_layers = [self.has_tensor(f"blk.{i}.ffn_gate_exps.weight") for i in range(layers)]
        first = expert_layers.index(True)
        num_experts, moe_intermediate = self._shape(f"blk.{first}.ffn_gate_exps.weight")[:2]
        shared = self._tensors.get(f"blk.{first}.ffn_gate_shexp.weight")
        return dict(
            architecture=MIXTRAL if self.arch == "llama" else self.family.architecture,
            num_experts=meta.get(f"{arch}.expert_count", num_experts),
            num_experts_per_tok=self.required(f"{arch}.expert_used_count"),
            moe_intermediate_size=moe_intermediate,
            norm_topk_prob=bool(meta.get(f"{arch}.expert_weights_norm", self.family.experts_normalized)),
            shared_expert_intermediate_size=0 if shared is None else self._shape(shared.name)[0],
            expert_layers=expert_layers)

    def _shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape, outermost dimension first (GGUF lists them innermost first)."""
        return tuple(int(d) for d in reversed(self._tensors[name].shape))

    @functools.cached_property
    def _native_groups(self) -> dict[str, tuple[tuple[str, ...], BlockLayout]]:
        """Our decoder-layer projection ("layers.3.qkv_proj"), or the output head ("lm_head"), -> its GGUF tensors and
        the layout they run as, for those whose every part is stored in a type that runs as stored
        (gguf_blocks.NATIVE_GROUP_SIZES: Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, Q8_0). A projection with a part in another
        type (F16, Q2_K, Q3_K, Q5_0, IQ types) does not qualify, nor does a head tied to the embedding table (no
        output.weight). Experts are not projections: they are dequantized."""
        types = {t.name: t.tensor_type.name for t in self.reader.tensors}
        layers = {int(name.split(".")[1]) for name in types if name.startswith("blk.")}
        groups = {}
        for i in sorted(layers):
            for projection, parts in {**_PROJECTION_PARTS, **self.family.projections}.items():
                names = tuple(f"blk.{i}.{part}.weight" for part in parts)
                layout = block_layout(tuple(types.get(name, "absent") for name in names))
                if layout is not None:
                    groups[f"layers.{i}.{projection}"] = names, layout
        head = block_layout((types.get("output.weight", "absent"),))  # Q4_K_M files store it in Q6_K
        if head is not None:
            groups["lm_head"] = ("output.weight",), head
        return groups

    def native_projections(self) -> dict[str, BlockLayout]:
        """The projections, and the output head ("lm_head"), that run as the file stores them (quantization='gguf'),
        and the layout each runs as."""
        return {projection: layout for projection, (_, layout) in self._native_groups.items()}

    def iter_weights(self, keep_native_blocks: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, float32 tensor) for every weight, with what llama.cpp's converter did undone: Q/K rows
        permuted back, Gemma's (1 + weight) norms back to weight, merged experts split per expert.
        keep_native_blocks: a part of one of native_projections() comes as three row-indexed tensors instead,
        <module>.qcodes, .qscales and .qmins in its projection's group size (loader/gguf_blocks.py)."""
        kept = {name: layout.group_size for names, layout in self._native_groups.values() for name in names} \
            if keep_native_blocks else {}
        cfg_heads = self.required(f"{self.arch}.attention.head_count")
        kv_heads = self.metadata.get(f"{self.arch}.attention.head_count_kv", cfg_heads)
        family = self.family
        for tensor in self.reader.tensors:
            if tensor.name in ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"):
                continue  # folded into the rotary embedding by model_config()
            name = self._hf_name(tensor.name)
            shape = self._shape(tensor.name)
            if tensor.name in kept:
                parts = unpack_blocks(tensor.data, tensor.tensor_type.name, shape, kept[tensor.name])
                named = [(name.replace(".weight", suffix), part)
                         for suffix, part in zip((".qcodes", ".qscales", ".qmins"), parts)]
            elif tensor.tensor_type.name in NATIVE_GROUP_SIZES:  # experts too: [experts * rows, cols], reshaped
                flat = (math.prod(shape[:-1]), shape[-1])
                named = [(name, dequantize_blocks(tensor.data, tensor.tensor_type.name, flat).view(shape))]
            else:
                named = [(name, torch.from_numpy(self._dequantize(tensor).copy()))]
            module = tensor.name.split(".")[2] if tensor.name.startswith("blk.") else ""
            if family.norm_shift and tensor.name.endswith("norm.weight"):
                named = [(name, weight - family.norm_shift) for name, weight in named]
            elif module in MERGED_EXPERTS:  # [experts, rows, cols]: one tensor an expert, as Hugging Face stores them
                named = [(name.replace(".experts.", f".experts.{e}."), weight[e])
                         for name, weight in named for e in range(weight.shape[0])]
            elif module == "ffn_gate_inp_shexp":  # the shared expert's gate: one row, however the file shapes it
                named = [(name, weight.reshape(1, -1)) for name, weight in named]
            for part_name, weight in named:  # every row-indexed part is permuted alike
                if family.permuted_qk and ".self_attn.q_proj." in part_name:
                    weight = _unpermute_rows(weight, cfg_heads)
                elif family.permuted_qk and ".self_attn.k_proj." in part_name:
                    weight = _unpermute_rows(weight, kv_heads)
                yield part_name, weight

    def _hf_name(self, gguf_name: str) -> str:
        if gguf_name in _TENSOR_NAMES:
            return _TENSOR_NAMES[gguf_name]
        parts = gguf_name.split(".")
        if parts[0] == "blk" and len(parts) == 4:
            if parts[2] in MERGED_EXPERTS:
                return f"model.layers.{parts[1]}.mlp.experts.{MERGED_EXPERTS[parts[2]]}.{parts[3]}"
            if parts[2] in self._layer_names:
                return f"model.layers.{parts[1]}.{self._layer_names[parts[2]]}.{parts[3]}"
        raise ValueError(f"GGUF tensor {gguf_name!r} in {self.path.name} is not part of a supported {self.arch} "
                         "model; the file holds a variant of the architecture that is not supported")

    def _dequantize(self, tensor) -> np.ndarray:
        from gguf import quants

        try:
            values = quants.dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError as exc:
            raise ValueError(f"GGUF tensor {tensor.name!r} in {self.path.name} has type {tensor.tensor_type.name}, "
                             "which this gguf package cannot dequantize; convert the file to F16, Q8_0, Q6_K, "
                             "Q5_K, Q4_K, Q4_0 or Q4_1 (llama.cpp's llama-quantize)") from exc
        # GGUF lists dimensions innermost first; torch wants them outermost first
        return values.reshape(self._shape(tensor.name)).astype(np.float32, copy=False)


def _unpermute_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's convert-time row order (pairs interleaved per head) back to Hugging Face's halves."""
    rows = weight.shape[0]
    head_dim = rows // num_heads
    return (weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
            .transpose(1, 2).reshape(weight.shape))
