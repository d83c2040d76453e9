"""A mixture-of-experts FFN (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2): a router picks top_k experts per token,
each a gated FFN, and the token's output is their weighted sum (plus a shared expert every token runs: Qwen2-MoE's
scaled by a sigmoid gate, DeepSeek-V2's as it is).

The experts' weights are stacked ([E, 2I, H] gate and up, [E, H, I] down), the layout a grouped GEMM over tokens
sorted by expert reads: on a GPU kernels/fused_moe.py runs them in two launches; elsewhere run_experts, the torch
reference, runs each chosen expert over its tokens. Under tensor parallelism each rank holds every expert (and the
shared expert) on its share of I (w_gate_up's rows, w_down's columns), as the dense FFN is split: the router is
replicated, every rank routes alike, and the output is this rank's partial sum, summed over ranks by the decoder
layer's all-reduce as a dense FFN's is.

Quantized (quantization='int8', 'w8a8', 'int4': int8 codes; 'fp8': e4m3; layers/quantization/experts.py), it holds
each expert's weights as codes with an fp32 scale per output channel (hold_codes), read as codes by the GPU kernels.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SparseMoE(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int, normalize: bool,
                 act: nn.Module, shared_intermediate_size: int = 0, shared_gated: bool = True,
                 routed_scale: float = 1.0, groups: tuple[int, int] | None = None):
        """normalize: the top_k weights rescaled to sum to 1 (Mixtral; Qwen's norm_topk_prob). shared_gated: the shared
        expert's output scaled by a sigmoid gate (Qwen2-MoE). routed_scale and groups: route()'s scale and groups."""
        super().__init__()
        self.top_k, self.normalize, self.act = top_k, normalize, act
        self.routed_scale, self.groups = routed_scale, groups
        # a plain parameter, not an nn.Linear: quantization leaves the router in float (routing decides everything)
        self.router = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.w_gate_up = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.w_down = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        if shared_intermediate_size:
            self.shared_gate_up = nn.Linear(hidden_size, 2 * shared_intermediate_size, bias=False)
            self.shared_down = nn.Linear(shared_intermediate_size, hidden_size, bias=False)
            self.shared_expert_gate = nn.Parameter(torch.empty(1, hidden_size)) if shared_gated else None
        else:
            self.shared_gate_up = None
        self.scales: tuple[torch.Tensor, torch.Tensor] | None = None  # quantized experts: per output channel

    def hold_codes(self, gate_up: tuple[torch.Tensor, torch.Tensor], down: tuple[torch.Tensor, torch.Tensor]) -> None:
        """The experts' weights replaced by (codes, fp32 scales per output channel): [E, 2I, H] and [E, 2I], [E, H, I]
        and [E, H]."""
        self.w_gate_up = nn.Parameter(gate_up[0], requires_grad=False)
        self.w_down = nn.Parameter(down[0], requires_grad=False)
        self.scales = gate_up[1], down[1]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, H] -> [T, H]."""
        weights, experts = route(hidden, self.router, self.top_k, self.normalize, self.routed_scale, self.groups)
        if hidden.is_cuda:
            from fasterllm.kernels.fused_moe import fused_experts  # Triton: only with CUDA

            out = fused_experts(hidden, self.w_gate_up, self.w_down, weights, experts, self.act.name,
                                scales=self.scales)
        else:
            out = run_experts(hidden, self.w_gate_up, self.w_down, weights, experts, self.act, self.scales)
        if self.shared_gate_up is not None:
            shared = self.shared_down(self.act(self.shared_gate_up(hidden)))
            out += shared if self.shared_expert_gate is None else torch.sigmoid(
                F.linear(hidden, self.shared_expert_gate)) * shared
        return out


def run_experts(hidden: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, weights: torch.Tensor,
                experts: torch.Tensor, act: nn.Module, scales: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> torch.Tensor:
    """Each token's sum of weight * down(act(gate_up(x))) over its chosen experts, an expert at a time (the
    routing is read on the host: not capturable in a CUDA graph). scales: the weights are codes with these scales
    per output channel (the codes widened to hidden's dtype, each product's columns scaled)."""
    out = torch.zeros_like(hidden)

    def project(x: torch.Tensor, weight: torch.Tensor, which: int, expert: int) -> torch.Tensor:
        if scales is None:
            return F.linear(x, weight[expert])
        return F.linear(x, weight[expert].to(x.dtype)) * scales[which][expert].to(x.dtype)

    for expert in experts.unique().tolist():
        tokens, slots = (experts == expert).nonzero(as_tuple=True)
        expert_out = project(act(project(hidden[tokens], w_gate_up, 0, expert)), w_down, 1, expert)
        out.index_add_(0, tokens, expert_out * weights[tokens, slots, None])
    return out


def route(hidden: torch.Tensor, router: torch.Tensor, top_k: int, normalize: bool, scale: float = 1.0,
          groups: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's top_k experts [T, k] and their weights [T, k] (in hidden's dtype): softmax over every expert's
    logit in fp32, the k largest kept, rescaled to sum 1 when normalize, then times scale (DeepSeek's
    routed_scaling_factor). groups (num_groups, kept_groups): the experts split into num_groups equal groups in order,
    each ranked by its best probability, the k chosen from the kept_groups best only (DeepSeek-V2's
    group_limited_greedy; weights stay the softmax over all experts). On a GPU without groups in one Triton launch
    after the router's product: kernels/moe_routing.py."""
    if hidden.is_cuda:  # one token through the matrix-vector kernel, as the dense layers' products
        from fasterllm.layers.gpu_linear import float_linear  # Triton: only with CUDA

        logits = float_linear(hidden.contiguous(), router)
    else:
        logits = F.linear(hidden, router)
    if hidden.is_cuda and groups is None:
        from fasterllm.kernels.moe_routing import route_logits  # Triton: only with CUDA

        return route_logits(logits, top_k, normalize, hidden.dtype, scale)
    probabilities = logits.float().softmax(dim=-1)
    if groups is not None:
        num_groups, kept_groups = groups
        by_group = probabilities.view(probabilities.shape[0], num_groups, -1)
        best_groups = by_group.amax(dim=-1).topk(kept_groups, dim=-1).indices
        kept = torch.zeros_like(by_group[..., 0], dtype=torch.bool).scatter_(1, best_groups, True)
        probabilities = by_group.masked_fill(~kept[..., None], 0.0).view_as(probabilities)
    weights, experts = probabilities.topk(top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if scale != 1.0:  # DeepSeek's routed_scaling_factor; every other family skips the multiply
        weights = weights * scale
    return weights.to(hidden.dtype), experts
