"""A CPU decode step of a BART-family encoder-decoder (BART, mBART, Marian, M2M100) through every decoder layer in one
C++ call (kernels/native/cpu/seq2seq_decode_stack.cpp). The call chains the operators the layers call one by one (the
products, the K/V store, SDPA over the paged blocks or the C++ decode attention where the Python path takes it,
the LayerNorms, the activation), in the same order on the same tensors, so its result is the layers' to the bit; what
it removes is the Python between them, about a fifth of a Marian-base fp32 step on two cores.

Built for a model whose decoder layers are all models/bart.py's DecoderLayer, with LayerNorms of one eps and
projections one of our C++ kernels' quantized layers or a float one (packed for oneDNN, or plain); taken for a decode
step (one new token per sequence, no prompt among them) whose self- and cross-attention both read one decode group,
over a cache of the model's dtype. Any other step runs the layers in Python.
"""
from __future__ import annotations

import torch
from torch import nn

from fasterllm.kernels.native import cpu_attention, cpu_extension
from fasterllm.kernels.native.cpu_extension import kernel_isa
from fasterllm.layers.attention import AttentionMetadata, DecodeGroup
from fasterllm.models.cpu_decode_linears import NONE, stack_linears

ACTIVATIONS = {"silu", "gelu", "gelu_tanh", "relu"}  # seq2seq_decode_stack.cpp's


def _norms(layer: nn.Module) -> list[nn.Module]:
    return [layer.self_attn_layer_norm, layer.encoder_attn_layer_norm, layer.final_layer_norm]


class Seq2SeqDecodeStack:
    """A BART-family decoder's layers as seq2seq_decode_stack.cpp takes them (their weights' tensors, made once), and
    the call."""

    def __init__(self, model: nn.Module, norms: list[torch.Tensor], linear_tensors: list[torch.Tensor],
                 kinds: list[int]):
        cfg, first = model.config, model.decoder.layers[0]
        self.norms, self.linear_tensors, self.kinds = norms, linear_tensors, kinds
        self.eps, self.pre_norm, self.activation = first.self_attn_layer_norm.eps, cfg.pre_norm, cfg.activation
        self.num_heads, self.head_dim = first.num_heads, first.head_dim
        self.scale, self.cross_scale = first.self_attn.scale, first.cross_attn.scale
        self.dtype = first.self_attn_layer_norm.weight.dtype
        # what _decode_attention's choice of the C++ attention reads of a query: its head size, dtype and device
        self.probe = torch.empty(0, self.num_heads, self.head_dim, dtype=self.dtype)

    @classmethod
    def of(cls, model: nn.Module) -> Seq2SeqDecodeStack | None:
        """The stack for a BartForConditionalGeneration's decoder, or None where a layer is not one it runs."""
        from fasterllm.models.bart import DecoderLayer

        layers = list(model.decoder.layers)
        if not layers or model.config.activation not in ACTIVATIONS or not cpu_extension.available():
            return None
        first = layers[0]
        eps, dtype = first.self_attn_layer_norm.eps, first.self_attn_layer_norm.weight.dtype
        norms, linear_tensors, kinds = [], [], []
        for layer in layers:
            if (type(layer) is not DecoderLayer
                    or any(type(norm) is not nn.LayerNorm or norm.eps != eps or norm.weight is None
                           or norm.bias is None for norm in _norms(layer))
                    or layer.self_attn.scale != first.self_attn.scale
                    or layer.self_attn.softcap is not None or layer.self_attn.sliding_window is not None
                    or layer.self_attn.kv_scales != (1.0, 1.0) or layer.cross_attn.kv_scales != (1.0, 1.0)
                    or layer.cross_attn.scale != first.cross_attn.scale):
                return None
            linears = stack_linears([layer.qkv_proj, layer.out_proj, layer.cross_q_proj, layer.cross_out_proj,
                                     layer.fc1, layer.fc2])
            if linears is None:
                return None
            linear_tensors += linears[0]
            kinds += linears[1]
            norms += [tensor for norm in _norms(layer) for tensor in (norm.weight, norm.bias)]
        if any(norm.dtype != dtype for norm in norms):
            return None
        return cls(model, norms, linear_tensors, kinds)

    def takes(self, hidden: torch.Tensor, kv_caches: torch.Tensor | None, meta: AttentionMetadata) -> bool:
        """Whether this step is one the stack runs: a decode batch (one token per sequence, no prompt) over a cache of
        the model's dtype, its self- and cross-attention each one decode group of every row."""
        cross = meta.cross
        return (hidden.dtype == self.dtype and kv_caches is not None and kv_caches.dtype == self.dtype
                and meta.kernel is None and not meta.prefills and _whole_batch(meta.decode)
                and cross is not None and cross.kernel is None and not cross.prefills and _whole_batch(cross.decode))

    def __call__(self, hidden: torch.Tensor, kv_caches: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The decoder's embedded rows [B, H] -> the last layer's output [B, H] (a pre-norm model's final norm and
        the head still to apply)."""
        native = cpu_attention.runs(self.probe, kv_caches)  # the C++ attention takes this head size and dtype
        return torch.ops.fasterllm_cpu.seq2seq_decode_stack(
            hidden.contiguous(), self.norms, self.linear_tensors, self.kinds, self.eps, self.pre_norm,
            self.activation, kv_caches, meta.slot_mapping,
            *_group(meta.decode, native), *_group(meta.cross.decode, native),
            self.num_heads, self.head_dim, self.scale, self.cross_scale, kernel_isa())


def _group(group: DecodeGroup, native_attention: bool) -> tuple[list[torch.Tensor], list[int]]:
    """A decode group as the C++ call reads it (seq2seq_decode_stack.cpp's Group), with _decode_attention's choice
    between the C++ attention (where it takes the head size and dtype, and the group has key ranges) and SDPA."""
    blocks, runs = group.blocks, group.query_runs
    native = native_attention and group.key_ranges is not None
    tensors = [NONE if isinstance(blocks, slice) else blocks, NONE if group.mask is None else group.mask,
               NONE if runs is None else runs[0], NONE if runs is None else runs[1],
               NONE if group.block_table is None else group.block_table,
               NONE if group.key_ranges is None else group.key_ranges]
    block_range = (blocks.start, blocks.stop) if isinstance(blocks, slice) else (0, 0)
    ints = [*block_range, group.keys.start, group.keys.stop, 1 if runs is None else runs[2], int(native)]
    return tensors, ints


def _whole_batch(decode: DecodeGroup | None) -> bool:
    """Every row of the batch in one decode group."""
    return decode is not None and decode.token_index is None
