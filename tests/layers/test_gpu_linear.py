"""GPULinear: one row through the matrix-vector kernel, more rows through F.linear, the same answer either way
(in Triton's interpreter on a CPU; natively on a GPU)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("triton")
from fasterllm.layers.gpu_linear import GPULinear, use_gemv_linears  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("with_bias", [True, False])
def test_one_row_and_many_rows_match_f_linear(with_bias):
    torch.manual_seed(0)
    weight = torch.randn(48, 200, device=DEVICE)
    bias = torch.randn(48, device=DEVICE) if with_bias else None
    layer = GPULinear(weight, bias)
    rows = (torch.randn(1, 1, 200, device=DEVICE), torch.randn(200, device=DEVICE), torch.randn(3, 200, device=DEVICE))
    for x in rows:
        got = layer(x)
        assert got.shape == x.shape[:-1] + (48,)
        torch.testing.assert_close(got, F.linear(x, weight, bias), atol=1e-4, rtol=1e-4)


def test_use_gemv_linears_replaces_every_linear_over_the_same_weight():
    model = nn.Sequential(nn.Linear(8, 4), nn.Sequential(nn.Linear(4, 2, bias=False)))
    weights = [model[0].weight, model[1][0].weight]
    use_gemv_linears(model)
    assert isinstance(model[0], GPULinear) and isinstance(model[1][0], GPULinear)
    assert model[0].weight is weights[0] and model[1][0].weight is weights[1] and model[1][0].bias is None


@pytest.mark.parametrize("with_bias", [True, False])
def test_an_unaligned_output_width_is_padded_in_place_and_answers_the_same(with_bias):
    """A head of 50 outputs (as BART's 50,265: not a multiple of 8) runs over a zero-padded copy of 64 rows that
    replaces the weight's storage, so a tied embedding reading the same parameter still sees its rows, and the
    answers, for one row and for several, are F.linear's over the original weight."""
    torch.manual_seed(1)
    embedding = nn.Embedding(50, 32).to(DEVICE)
    original = embedding.weight.detach().clone()
    bias = torch.randn(50, device=DEVICE) if with_bias else None
    head = GPULinear(embedding.weight, bias)  # tied: the embedding's own parameter
    assert head.padded_weight.shape == (64, 32) and embedding.weight.data_ptr() == head.padded_weight.data_ptr()
    assert torch.equal(embedding.weight, original) and embedding.weight.shape == (50, 32)
    assert torch.equal(embedding(torch.tensor([3, 49], device=DEVICE)), original[[3, 49]])
    for shape in ((1, 32), (5, 32), (2, 3, 32)):
        x = torch.randn(*shape, device=DEVICE)
        got = head(x)
        assert got.shape == x.shape[:-1] + (50,)
        torch.testing.assert_close(got, F.linear(x, original, bias), atol=1e-4, rtol=1e-4)


def test_an_aligned_output_width_keeps_its_weight():
    weight = torch.randn(48, 16, device=DEVICE)
    layer = GPULinear(weight, None)
    assert layer.padded_weight is None and layer.weight is weight
