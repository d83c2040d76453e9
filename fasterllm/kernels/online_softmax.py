"""The online-softmax (flash attention) step both attention kernels share, in log2 units."""
from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # scores are scaled by softmax_scale * LOG2E so exp2 can be used


@triton.jit
def dot(a, b, IEEE: tl.constexpr):
    """a @ b; IEEE for fp32 inputs (full precision, not TF32)."""
    if IEEE:
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def online_softmax_update(scores, v, row_max, row_sum, acc, IEEE: tl.constexpr):
    """Fold one key tile (scores [M, N] in log2 units, -inf where hidden; v [N, D]) into the running max,
    sum and unnormalised output of each query row. Returns (row_max, row_sum, acc)."""
    new_max = tl.maximum(row_max, tl.max(scores, axis=1))
    # a row that has seen no visible key yet keeps max -inf: subtract 0 so exp2 gives 0, not NaN
    safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
    probs = tl.math.exp2(scores - safe_max[:, None])
    correction = tl.math.exp2(row_max - safe_max)
    row_sum = row_sum * correction + tl.sum(probs, axis=1)
    acc = acc * correction[:, None] + dot(probs.to(v.dtype), v, IEEE)
    return new_max, row_sum, acc
