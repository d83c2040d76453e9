"""BERT-family encoders (BERT, RoBERTa, XLM-R) over packed tokens: padding is never materialised.

The batch's real tokens are one [total_tokens, hidden] tensor from the embedding lookup to the last
LayerNorm (Effective Transformer / ByteTransformer: remove padding once, keep it removed through every
layer). Every GEMM, bias, GELU and LayerNorm runs on real tokens only; attention runs over each
sequence's range of rows (layers/varlen_attention.py). Q, K and V are one GEMM; bias+GELU ride in the
FFN GEMM's epilogue on the CPU (layers/fused_linear.py); the residual is added in place before each LayerNorm,
or, on a GPU, bias + residual + LayerNorm are one Triton kernel (kernels/layer_norm.py).
"""
from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from fasterllm.config import BertConfig
from fasterllm.layers.fused_linear import FusedLinear
from fasterllm.layers.varlen_attention import VarlenBatch, varlen_attention

class BertEmbeddings(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # single-segment inputs: every token has token type 0
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions) + self.token_type_embeddings.weight[0]
        return self.norm(x)


class BertLayer(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.qkv = FusedLinear(hidden, 3 * hidden)
        self.attn_out = FusedLinear(hidden, hidden)
        self.attn_norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.ffn_up = FusedLinear(hidden, config.intermediate_size, activation=config.hidden_act)
        self.ffn_down = FusedLinear(config.intermediate_size, hidden)
        self.ffn_norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor, batch: VarlenBatch) -> torch.Tensor:
        attended = varlen_attention(self.qkv(x), batch, self.num_heads)
        x = self.attn_out.add_norm(attended, x, self.attn_norm)
        return self.ffn_down.add_norm(self.ffn_up(x), x, self.ffn_norm)


# Hugging Face names (prefix removed) -> ours; q/k/v land in thirds of qkv
_RENAMES = [
    (re.compile(r"^embeddings\.LayerNorm\."), "embeddings.norm."),
    (re.compile(r"^encoder\.layer\.(\d+)\.attention\.output\.dense\."), r"layers.\1.attn_out."),
    (re.compile(r"^encoder\.layer\.(\d+)\.attention\.output\.LayerNorm\."), r"layers.\1.attn_norm."),
    (re.compile(r"^encoder\.layer\.(\d+)\.intermediate\.dense\."), r"layers.\1.ffn_up."),
    (re.compile(r"^encoder\.layer\.(\d+)\.output\.dense\."), r"layers.\1.ffn_down."),
    (re.compile(r"^encoder\.layer\.(\d+)\.output\.LayerNorm\."), r"layers.\1.ffn_norm."),
]
_QKV = re.compile(r"^encoder\.layer\.(\d+)\.attention\.self\.(query|key|value)\.(weight|bias)$")
_IGNORED = re.compile(r"^(pooler\.|cls\.|lm_head\.|embeddings\.position_ids$|.*\.num_batches_tracked$)")
_MODEL_PREFIXES = ("bert.", "roberta.", "model.")


class BertModel(nn.Module):
    """Packed input_ids [total_tokens] -> last hidden states [total_tokens, hidden]."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.layers = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: VarlenBatch) -> torch.Tensor:
        """positions count from 0 within each sequence; the position offset (RoBERTa) is added here."""
        x = self.embeddings(input_ids, positions + self.config.position_offset)
        for layer in self.layers:
            x = layer(x, batch)
        return x

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        missing = set(params)
        hidden = self.config.hidden_size
        thirds_loaded: dict[str, set[int]] = {}  # fused qkv parameter -> which of q, k, v arrived
        for hf_name, tensor in weights:
            name = _strip_prefix(hf_name).replace(".gamma", ".weight").replace(".beta", ".bias")
            if _IGNORED.match(name):
                continue
            qkv = _QKV.match(name)
            if qkv:
                layer, which, kind = qkv.groups()
                target = f"layers.{layer}.qkv.{kind}"
                third = ("query", "key", "value").index(which)
                rows = params[target].data.narrow(0, third * hidden, hidden)
                if rows.shape != tensor.shape:
                    raise ValueError(f"checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}, the config "
                                     f"implies {tuple(rows.shape)}; config.json and the weights disagree")
                rows.copy_(tensor)
                thirds_loaded.setdefault(target, set()).add(third)
                if len(thirds_loaded[target]) == 3:  # loaded once query, key and value all are
                    missing.discard(target)
                continue
            for pattern, replacement in _RENAMES:
                name = pattern.sub(replacement, name)
            if name not in params:
                raise ValueError(f"checkpoint tensor {hf_name!r} has no place in {self.config.model_type} "
                                 "BertModel; the checkpoint is not a BERT-family encoder")
            if params[name].shape != tensor.shape:
                raise ValueError(f"checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}, the config "
                                 f"implies {tuple(params[name].shape)}; config.json and the weights disagree")
            params[name].data.copy_(tensor)
            missing.discard(name)
        if missing:
            raise ValueError(f"the checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}; "
                             "it is incomplete or not a BERT-family encoder")

    def pack_for_cpu(self) -> None:
        for module in self.modules():
            if isinstance(module, FusedLinear):
                module.pack_for_cpu()


def _strip_prefix(name: str) -> str:
    for prefix in _MODEL_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    return name
