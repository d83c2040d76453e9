"""A CPU decode step (one sequence's, or a batch's) through every decoder layer of a Llama-family model in one C++ call
(kernels/native/cpu/decode_stack.cpp). The call chains the operators the layers call one by one (the add + RMSNorm,
the quantized products, RoPE with the K/V store, the decode attention, SiLU(gate) * up), in the same order on the same
tensors, so its result is the layers' to the bit; what it removes is the Python between them, which was about a
quarter of a SmolLM2 int8 step on two cores (benchmarks/RESULTS.md, sixteenth session).

Built for a model whose layers are all pre-norm SiLU layers (biases, Qwen3's per-head q/k norms and one sliding
window for all layers allowed; no clipping, soft-capping or experts; one full-width rotary table), each projection
one of our C++ kernels' int8 / int4 / uint8-grouped layers or a float one (fp32 tiles, packed for oneDNN, or plain), in
bf16, or in fp32 released from bit-equality with transformers (every model build_decoder makes for the CPU, as the
layers' own C++ calls are: a layer that keeps torch's norm and attention keeps the Python layers); taken for a decode
step (one sequence's or a batch's, no prompt among them) over a cache of the model's dtype. Any other model or step
runs the layers in Python.
"""
from __future__ import annotations

import torch
from torch import nn

from fasterllm.kernels.native import cpu_attention
from fasterllm.kernels.native.cpu_extension import kernel_isa
from fasterllm.layers.activation import SiluAndMul
from fasterllm.layers.attention import AttentionMetadata
from fasterllm.layers.norm import RMSNorm
from fasterllm.models.cpu_decode_linears import NONE, stack_linears


def _plain_layer(layer: nn.Module, dtype: torch.dtype, eps: float) -> bool:
    """Whether a decoder layer is one the C++ stack runs as its Python forward would (its norms' eps all eps)."""
    from fasterllm.models.llama import DecoderLayer

    attn = layer.attn
    norms = [layer.input_layernorm, layer.post_attention_layernorm]
    if layer.q_norm is not None:  # Qwen3's, per head (not OLMoE's, over all heads)
        norms += [layer.q_norm, layer.k_norm]
        if layer.q_norm.weight.shape[0] != attn.head_dim:
            return False
    return (type(layer) is DecoderLayer and layer.leaves_down_proj and type(layer.act) is SiluAndMul
            and all(type(norm) is RMSNorm and norm.eps == eps for norm in norms)
            and layer.clip_qkv is None
            and attn.softcap is None and attn.kv_scales == (1.0, 1.0) and attn.head_dim in cpu_attention.HEAD_DIMS
            and dtype in (torch.bfloat16, torch.float32))


class CPUDecodeStack:
    """A model's layers as decode_stack.cpp takes them (their weights' tensors, made once), and the call."""

    def __init__(self, norms: list[torch.Tensor], linear_tensors: list[torch.Tensor], kinds: list[int], eps: float,
                 attn: nn.Module, dtype: torch.dtype):
        self.norms, self.linear_tensors, self.kinds, self.eps, self.dtype = norms, linear_tensors, kinds, eps, dtype
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.scale, self.sliding_window = attn.scale, attn.sliding_window  # every layer's

    @classmethod
    def of(cls, model: nn.Module) -> CPUDecodeStack | None:
        """The stack for a LlamaForCausalLM's layers, or None where one of them is not a layer it runs."""
        layers = list(getattr(model, "layers", []))
        if (not layers or model.tp.size > 1 or len(model.rotaries) != 1
                or model.config.rotary_dim != layers[0].attn.head_dim):
            return None
        dtype, eps = layers[0].input_layernorm.weight.dtype, layers[0].input_layernorm.eps
        norms, linear_tensors, kinds = [], [], []
        for layer in layers:
            if not _plain_layer(layer, dtype, eps) or any(getattr(layer.attn, name) != getattr(layers[0].attn, name)
                                                          for name in ("scale", "sliding_window")):
                return None
            linears = stack_linears([layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj])
            if linears is None:
                return None
            linear_tensors += linears[0]
            kinds += linears[1]
            norms += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
            norms += [NONE, NONE] if layer.q_norm is None else [layer.q_norm.weight, layer.k_norm.weight]
        return cls(norms, linear_tensors, kinds, eps, layers[0].attn, dtype)

    def takes(self, hidden: torch.Tensor, kv_caches: torch.Tensor | None, meta: AttentionMetadata) -> bool:
        """Whether this step is one the stack runs: a decode batch (one token per sequence, no prompt) over a cache
        of the model's dtype, its keys cut to the layers' window, its attention one the C++ call runs (no position
        bias on the mask)."""
        decode = meta.decode
        return (hidden.dtype == self.dtype and kv_caches is not None and kv_caches.dtype == self.dtype
                and meta.sliding_window == self.sliding_window and meta.kernel is None and not meta.prefills
                and decode is not None and decode.token_index is None and decode.key_ranges is not None)

    def __call__(self, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_caches: torch.Tensor,
                 meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """The embedding's rows [B, H] -> (the last layer's SiLU(gate) * up, the residual stream): what the layers'
        loop hands the final norm, with the last down projection still to apply."""
        return torch.ops.fasterllm_cpu.decode_stack(
            hidden.contiguous(), self.norms, self.linear_tensors, self.kinds, self.eps, *rope,
            kv_caches, meta.slot_mapping, meta.decode.block_table, meta.decode.key_ranges, self.num_heads,
            self.num_kv_heads, self.head_dim, self.scale, kernel_isa())
