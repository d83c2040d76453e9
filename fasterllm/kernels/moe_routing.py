"""A mixture of experts' routing after the router's matrix product, in one Triton launch (GPU): per token, the
softmax over every expert's logit in fp32, the top_k experts (the largest probability first; the lowest index among
equal ones), and their weights, rescaled to sum 1 where the model asks, then times the model's scale (DeepSeek's
routed_scaling_factor). The torch reference is layers/moe.py's
route(), which takes seven launches for the same (a decode step's cost adds up over 48 layers)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fasterllm.kernels.dependent_launch import early_launch, early_start


@triton.jit
def _route_kernel(logits_ptr, weights_ptr, experts_ptr, num_experts, stride_t, scale, TOP_K: tl.constexpr,
                  NORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    early_start(PDL)
    token = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    logits = tl.load(logits_ptr + token * stride_t + e, mask=e < num_experts, other=float("-inf")).to(tl.float32)
    p = tl.exp(logits - tl.max(logits, axis=0))
    p = p / tl.sum(p, axis=0)
    # the lanes past the experts, and every lane of a row whose logits are not numbers, at -1: below every real
    # probability. Such a row (a CUDA graph's padding token row holds whatever its buffers held) still gets k distinct
    # real experts, the lowest first, with meaningless weights (it is thrown away); an index past the experts would
    # send the grouping's atomics and the expert kernels' reads outside their tensors
    p = tl.where((e < num_experts) & (p == p), p, -1.0)
    k = tl.arange(0, BLOCK_K)
    chosen = tl.zeros((BLOCK_K,), dtype=tl.float32)
    indices = tl.zeros((BLOCK_K,), dtype=tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.max(p, axis=0)
        index = tl.min(tl.where(p == best, e, BLOCK_E), axis=0)
        chosen = tl.where(k == j, best, chosen)
        indices = tl.where(k == j, index.to(tl.int64), indices)
        p = tl.where(e == index, -2.0, p)  # below every other lane: never chosen again
    if NORMALIZE:
        chosen = chosen / tl.sum(chosen, axis=0)
    chosen = chosen * scale
    tl.store(weights_ptr + token * TOP_K + k, chosen.to(weights_ptr.dtype.element_ty), mask=k < TOP_K)
    tl.store(experts_ptr + token * TOP_K + k, indices, mask=k < TOP_K)


def route_logits(logits: torch.Tensor, top_k: int, normalize: bool, dtype: torch.dtype, scale: float = 1.0
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (the router's) -> (weights [T, k] in dtype, experts [T, k] int64), as layers/moe.py's route()
    without groups."""
    num_tokens, num_experts = logits.shape
    if top_k > num_experts:
        raise ValueError(f"top_k={top_k} is more than the {num_experts} experts")
    weights = torch.empty(num_tokens, top_k, dtype=dtype, device=logits.device)
    experts = torch.empty(num_tokens, top_k, dtype=torch.int64, device=logits.device)
    if num_tokens:
        _route_kernel[(num_tokens,)](logits, weights, experts, num_experts, logits.stride(0), scale, TOP_K=top_k,
                                     NORMALIZE=normalize, BLOCK_E=triton.next_power_of_2(num_experts),
                                     BLOCK_K=triton.next_power_of_2(top_k), **early_launch(logits.device))
    return weights, experts
