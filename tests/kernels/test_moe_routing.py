"""The one-launch MoE routing (kernels/moe_routing.py) against the torch route of layers/moe.py: in Triton's
interpreter on a CPU, natively on a GPU. Expert counts that are not powers of two, top_k that is not either, with and
without renormalisation."""
from __future__ import annotations

import pytest
import torch

from fasterllm.layers.moe import route

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytest.importorskip("triton")
from fasterllm.kernels.moe_routing import route_logits  # noqa: E402


@pytest.mark.parametrize("num_experts, top_k", [(8, 2), (60, 4), (64, 6), (128, 8)])
@pytest.mark.parametrize("normalize", [True, False])
def test_the_same_experts_and_weights_as_the_torch_route(num_experts, top_k, normalize):
    generator = torch.Generator().manual_seed(num_experts + top_k)
    hidden, router = torch.randn(7, 32, generator=generator), torch.randn(num_experts, 32, generator=generator)
    expected_weights, expected_experts = route(hidden, router, top_k, normalize)  # the CPU's torch path
    weights, experts = route_logits((hidden @ router.T).to(DEVICE), top_k, normalize, torch.float32)
    assert experts.tolist() == expected_experts.tolist()
    torch.testing.assert_close(weights.cpu(), expected_weights, atol=1e-6, rtol=1e-5)
    if normalize:
        torch.testing.assert_close(weights.sum(dim=-1).cpu(), torch.ones(7))


def test_equal_probabilities_go_to_the_lowest_expert_first():
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 2.0]], device=DEVICE)
    weights, experts = route_logits(logits, 3, normalize=True, dtype=torch.float32)
    assert experts.tolist() == [[1, 3, 4]]
    torch.testing.assert_close(weights.cpu(), torch.full((1, 3), 1 / 3))


def test_more_choices_than_experts_is_refused():
    with pytest.raises(ValueError, match="top_k=5 is more than the 4 experts"):
        route_logits(torch.zeros(1, 4, device=DEVICE), 5, normalize=False, dtype=torch.float32)
