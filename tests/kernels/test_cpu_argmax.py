"""The C++ argmax of fp32 rows (kernels/native/cpu_argmax.py) against torch.argmax: the same index for every row,
including ties (the first), NaNs (the first NaN), rows of -inf, signed zeros, and widths around its 8-lane vectors."""
from __future__ import annotations

import pytest
import torch

from fasterllm.kernels.native import cpu_argmax
from fasterllm.worker.sampler import row_argmax


@pytest.mark.parametrize("width", [1, 7, 8, 9, 16, 63, 58101])
def test_random_rows_and_special_values_match_torch(cpu_kernels_on, width):
    g = torch.Generator().manual_seed(width)
    rows = torch.randn(12, width, generator=g)
    last = width - 1
    rows[1, [0, last]] = 50.0  # a tie: the first wins
    rows[2, last] = 50.0  # the largest in the tail past the vectors
    rows[3] = float("-inf")  # every value -inf: index 0
    rows[4, last // 2] = float("nan")  # a NaN beats every number
    rows[5, [0, last]] = float("nan")
    rows[6] = 0.0
    rows[6, last] = -0.0  # -0 == +0: the first
    rows[7] = -0.0
    rows[8, last // 3] = float("inf")
    rows[9] = -1e30
    rows[10] = torch.arange(width, 0, -1, dtype=torch.float32)  # descending: index 0
    assert cpu_argmax.runs(rows)
    assert torch.equal(cpu_argmax.argmax_rows(rows), rows.argmax(dim=-1))
    assert torch.equal(row_argmax(rows), rows.argmax(dim=-1))  # what the sampler calls


def test_a_strided_view_and_other_inputs(cpu_kernels_on):
    rows = torch.randn(5, 100)
    view = rows[:, ::2]  # not contiguous: copied first
    assert torch.equal(cpu_argmax.argmax_rows(view), view.argmax(dim=-1))
    assert not cpu_argmax.runs(rows.bfloat16()) and not cpu_argmax.runs(rows[0]) and not cpu_argmax.runs(rows[:, :0])
    with pytest.raises(RuntimeError, match="argmax_rows takes fp32 rows"):
        cpu_argmax.argmax_rows(rows.double())
