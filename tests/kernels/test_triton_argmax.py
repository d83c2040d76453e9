"""The greedy sampler's Triton argmax against torch.argmax: the same index for every row, ties to the first, NaN
first, rows of -inf (a grammar that bans everything but what it masks), widths that are not a multiple of the chunk.
In Triton's interpreter on a CPU, natively on a GPU."""
from __future__ import annotations

import pytest
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytest.importorskip("triton")
from fasterllm.kernels.argmax import argmax_rows  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [1, 100, 4096, 9000])
def test_every_row_matches_torch(width, dtype):
    generator = torch.Generator().manual_seed(width)
    x = torch.randn(6, width, generator=generator).to(dtype)
    x[1] = 0.0  # all tied: index 0
    x[2, width // 2:] = x[2].max() + 1  # tied maxima across chunks: the first
    x[3] = float("-inf")
    x[4, width - 1] = float("nan")
    x[4, width // 3] = float("inf")
    x[5, width // 2] = float("nan")
    x[5, width - 1] = float("nan")
    x = x.to(DEVICE)
    assert argmax_rows(x).tolist() == torch.argmax(x, dim=-1).tolist()


def test_a_row_view_with_stride_and_no_rows():
    x = torch.randn(3, 2 * 5000, device=DEVICE)[:, :5000]
    assert argmax_rows(x).tolist() == torch.argmax(x, dim=-1).tolist()
    assert argmax_rows(x[:0]).shape == (0,)


def test_refuses_what_it_cannot_read():
    with pytest.raises(ValueError, match="contiguous last dim"):
        argmax_rows(torch.randn(4, 3, device=DEVICE).t())
    with pytest.raises(ValueError, match="float"):
        argmax_rows(torch.arange(6, device=DEVICE).view(2, 3))
    with pytest.raises(ValueError, match="32-bit float"):  # fp32 comparisons would lose float64's order
        argmax_rows(torch.tensor([[1e39, 1e40]], dtype=torch.float64, device=DEVICE))
