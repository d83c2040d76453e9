"""Each row's argmax of fp32 logits on the CPU in one C++ call (cpu/argmax_rows.cpp, AVX2): greedy decoding takes one
a step. torch's CPU argmax compares one value at a time, ~130 us over a 58,101-word vocabulary on two EPYC cores,
about 1% of a Marian-base step and 2-3% of a SmolLM2 int8 one; the C++ pass takes a few microseconds. The same
index as torch.argmax: the first of equal largest values, the first NaN where a row holds one
(tests/kernels/test_cpu_argmax.py)."""
from __future__ import annotations

import torch

from fasterllm.kernels.native import cpu_extension


def runs(x: torch.Tensor) -> bool:
    """Whether argmax_rows takes x: fp32 rows [rows, width > 0] on the CPU, and the extension built."""
    return (x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] > 0 and x.device.type == "cpu"
            and cpu_extension.available())


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x [rows, width] fp32 -> [rows] int64: torch.argmax(x, dim=-1)."""
    return torch.ops.fasterllm_cpu.argmax_rows(x)
