"""The one-launch MoE routing (kernels/moe_routing.py) against the torch route of layers/moe.py: in Triton's
interpreter on a CPU, natively on a GPU. Expert counts that are not powers of two, top_k that is not either, with and
without renormalisation, with DeepSeek's routed_scaling_factor; and the torch route (greedy and DeepSeek-V2's
group_limited_greedy) against transformers' DeepSeek-V2 router."""
from __future__ import annotations

import pytest
import torch

from fasterllm.layers.moe import route

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytest.importorskip("triton")
from fasterllm.kernels.moe_routing import route_logits  # noqa: E402


@pytest.mark.parametrize("num_experts, top_k", [(8, 2), (60, 4), (64, 6), (128, 8)])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("scale", [1.0, 2.5])
def test_the_same_experts_and_weights_as_the_torch_route(num_experts, top_k, normalize, scale):
    generator = torch.Generator().manual_seed(num_experts + top_k)
    hidden, router = torch.randn(7, 32, generator=generator), torch.randn(num_experts, 32, generator=generator)
    expected_weights, expected_experts = route(hidden, router, top_k, normalize, scale)  # the CPU's torch path
    weights, experts = route_logits((hidden @ router.T).to(DEVICE), top_k, normalize, torch.float32, scale)
    assert experts.tolist() == expected_experts.tolist()
    torch.testing.assert_close(weights.cpu(), expected_weights, atol=1e-6, rtol=1e-5)
    if normalize:
        torch.testing.assert_close(weights.sum(dim=-1).cpu(), torch.full((7,), scale))


def test_equal_probabilities_go_to_the_lowest_expert_first():
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 2.0]], device=DEVICE)
    weights, experts = route_logits(logits, 3, normalize=True, dtype=torch.float32)
    assert experts.tolist() == [[1, 3, 4]]
    torch.testing.assert_close(weights.cpu(), torch.full((1, 3), 1 / 3))


@pytest.mark.parametrize("num_experts, top_k", [(8, 2), (6, 6), (60, 4), (128, 8)])
def test_rows_of_stale_values_still_get_distinct_real_experts(num_experts, top_k):
    """A CUDA graph's padding token rows hold stale values, NaN or infinite among them: their experts must still
    be k distinct real ones (the grouping and the expert kernels index by them), and the real rows beside them keep
    theirs."""
    generator = torch.Generator().manual_seed(num_experts)
    logits = torch.randn(6, num_experts, generator=generator)
    logits[1] = float("nan")
    logits[2, :3] = float("nan")
    logits[3] = float("inf")
    logits[4, 0] = float("-inf")
    logits[5] = float("-inf")
    weights, experts = route_logits(logits.to(DEVICE), top_k, normalize=True, dtype=torch.float32)
    experts = experts.cpu()
    assert ((experts >= 0) & (experts < num_experts)).all(), experts
    assert all(len(set(row)) == top_k for row in experts.tolist())
    # the rows of numbers (one with an expert at -inf) as alone, and as the torch route's softmax and top-k
    _, alone = route_logits(logits[[0, 4]].to(DEVICE), top_k, normalize=True, dtype=torch.float32)
    assert experts[[0, 4]].tolist() == alone.tolist() == logits[[0, 4]].softmax(dim=-1).topk(top_k).indices.tolist()


def test_more_choices_than_experts_is_refused():
    with pytest.raises(ValueError, match="top_k=5 is more than the 4 experts"):
        route_logits(torch.zeros(1, 4, device=DEVICE), 5, normalize=False, dtype=torch.float32)


@pytest.mark.parametrize("method, groups", [("greedy", None), ("group_limited_greedy", (4, 2)),
                                            ("group_limited_greedy", (8, 3))])
def test_the_torch_route_chooses_as_transformers_deepseek_v2_router(method, groups):
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    num_groups, kept_groups = groups or (None, None)
    config = transformers.DeepseekV2Config(hidden_size=32, n_routed_experts=64, num_experts_per_tok=6,
                                           topk_method=method, n_group=num_groups, topk_group=kept_groups,
                                           routed_scaling_factor=16.0)
    reference = DeepseekV2TopkRouter(config)
    generator = torch.Generator().manual_seed(7)
    hidden = torch.randn(40, 32, generator=generator)
    with torch.no_grad():
        reference.weight.copy_(torch.randn(64, 32, generator=generator))
        _, expected_weights, expected_experts = reference(hidden)
    weights, experts = route(hidden, reference.weight.detach(), 6, False, 16.0, groups)
    # transformers' top_k is unsorted: compare each token's (expert, weight) pairs in expert order
    order, expected_order = experts.argsort(dim=-1), expected_experts.argsort(dim=-1)
    assert experts.gather(1, order).tolist() == expected_experts.gather(1, expected_order).tolist()
    torch.testing.assert_close(weights.gather(1, order), expected_weights.gather(1, expected_order))
    if groups is not None:  # the choices come from kept_groups groups at most, and differ from greedy ones
        assert max(len(set(row)) for row in (experts // (64 // num_groups)).tolist()) <= kept_groups
        greedy = route(hidden, reference.weight.detach(), 6, False, 16.0)[1]
        assert (greedy.sort(dim=-1).values != experts.sort(dim=-1).values).any()
