"""A mixture of experts' FFN for a step of a few tokens (GPU): matrix-vector products per (token, choice) slot, two
Triton launches, no grouping by expert and no tl.dot (it pads rows to 16). As kernels/gemv.py does for a dense
layer, each program owns a few output columns of one slot's expert and streams their rows of weights (contiguous
along K), so the speed is the speed of reading the chosen experts' bytes. Launch 1: act(gate) * up per slot; launch
2: its down projection, times the slot's routing weight, added into its token's output (fp32 atomics: a token's k
slots meet there). Used by kernels/fused_moe.py below UNGROUPED_SLOTS slots (an expert chosen by two slots is read
twice)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fasterllm.kernels.activation import gate_activation

# (BLOCK_N output columns, BLOCK_K weights per row per step) of each launch
_GATE_UP_TILE = (4, 512)
_DOWN_TILE = (8, 256)


@triton.jit
def _gate_up_gemv(x_ptr, w_ptr, out_ptr, experts_ptr, hidden, inter, stride_xt, stride_we, stride_wn, stride_os,
                  TOP_K: tl.constexpr, ACT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    slot = tl.program_id(0)
    expert = tl.load(experts_ptr + slot).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    weights = w_ptr + expert * stride_we + rows[:, None].to(tl.int64) * stride_wn
    gate = tl.zeros((BLOCK_N,), dtype=tl.float32)
    up = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + (slot // TOP_K) * stride_xt + ks, mask=ks < hidden, other=0.0).to(tl.float32)
        mask = (rows[:, None] < inter) & (ks[None, :] < hidden)
        w_gate = tl.load(weights + ks[None, :], mask=mask, other=0.0, eviction_policy="evict_first")
        w_up = tl.load(weights + inter * stride_wn + ks[None, :], mask=mask, other=0.0, eviction_policy="evict_first")
        gate += tl.sum(w_gate.to(tl.float32) * x[None, :], axis=1)
        up += tl.sum(w_up.to(tl.float32) * x[None, :], axis=1)
    tl.store(out_ptr + slot * stride_os + rows, (gate_activation(gate, ACT) * up).to(out_ptr.dtype.element_ty), mask=rows < inter)


@triton.jit
def _down_gemv(a_ptr, w_ptr, out_ptr, experts_ptr, routing_ptr, hidden, inter, stride_as, stride_we, stride_wn,
               stride_ot, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    slot = tl.program_id(0)
    expert = tl.load(experts_ptr + slot).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    weights = w_ptr + expert * stride_we + rows[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + slot * stride_as + ks, mask=ks < inter, other=0.0).to(tl.float32)
        w = tl.load(weights + ks[None, :], mask=(rows[:, None] < hidden) & (ks[None, :] < inter), other=0.0,
                    eviction_policy="evict_first")
        acc += tl.sum(w.to(tl.float32) * a[None, :], axis=1)
    routing = tl.load(routing_ptr + slot).to(tl.float32)
    tl.atomic_add(out_ptr + (slot // TOP_K) * stride_ot + rows, acc * routing, mask=rows < hidden)


def expert_gemv(hidden: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, routing_weights: torch.Tensor,
                experts: torch.Tensor, act_code: int) -> torch.Tensor:
    """As fused_experts (contiguous inputs, checked there): [T, H] fp32, each token's weighted sum over its k
    experts."""
    num_tokens, hidden_size = hidden.shape
    inter, top_k = w_gate_up.shape[1] // 2, experts.shape[1]
    num_slots = num_tokens * top_k
    gated = torch.empty(num_slots, inter, dtype=hidden.dtype, device=hidden.device)
    out = torch.zeros(num_tokens, hidden_size, dtype=torch.float32, device=hidden.device)
    (n1, k1), (n2, k2) = _GATE_UP_TILE, _DOWN_TILE
    _gate_up_gemv[(num_slots, triton.cdiv(inter, n1))](
        hidden, w_gate_up, gated, experts, hidden_size, inter, hidden.stride(0), w_gate_up.stride(0),
        w_gate_up.stride(1), gated.stride(0), TOP_K=top_k, ACT=act_code, BLOCK_N=n1, BLOCK_K=k1)
    _down_gemv[(num_slots, triton.cdiv(hidden_size, n2))](
        gated, w_down, out, experts, routing_weights, hidden_size, inter, gated.stride(0), w_down.stride(0),
        w_down.stride(1), out.stride(0), TOP_K=top_k, BLOCK_N=n2, BLOCK_K=k2)
    return out
