"""The fused all-reduce + norm kernel's bookkeeping in Triton's interpreter, one rank at a time: the other rank's row
is put where its NVLink write would land, and rank 0's launch must push its own row into both buffers, sum the two
(a -0.0 sent as +0.0), empty the copy of the call before, and move to the next copy each call. On GPUs,
tests/parity/test_gpu_tensor_parallel.py runs it across real ranks."""
from __future__ import annotations

import threading

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test; GPUs run the multi-rank test")
pytest.importorskip("triton")
from fasterllm.kernels.one_shot_all_reduce import COPIES, EMPTY, RankBuffers, all_reduce_add_rms_norm  # noqa: E402
from fasterllm.kernels.rms_norm import fused_add_rms_norm  # noqa: E402

WORLD, MAX_ROWS, HIDDEN = 2, 4, 64


def _in_time(call, seconds: float = 120.0):
    """call() on a thread: a kernel that waits for a slot nobody fills spins for ever, so fail instead of hanging."""
    result = []
    thread = threading.Thread(target=lambda: result.append(call()), daemon=True)
    thread.start()
    thread.join(seconds)
    assert result, f"the kernel still waited after {seconds} s: a slot it polls was never filled"
    return result[0]


@pytest.mark.parametrize("rows", [1, 3])
def test_rank_zero_sums_both_rows_and_cycles_its_copies(rows):
    generator = torch.Generator().manual_seed(rows)
    buffers = [torch.full((COPIES, WORLD, MAX_ROWS, HIDDEN), EMPTY, dtype=torch.int16) for _ in range(WORLD)]
    epochs = torch.zeros(MAX_ROWS, dtype=torch.int32)
    ranks = RankBuffers(torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64), epochs, 0, WORLD)
    weight = (torch.rand(HIDDEN, generator=generator) + 0.5).to(torch.bfloat16)
    residual = (torch.randint(-64, 64, (rows, HIDDEN), generator=generator) / 16).to(torch.bfloat16)
    for call in range(1, 5):
        # multiples of 1/16: every sum is exact, so the interpreter's rounding (toward zero) does not enter
        mine, theirs = ((torch.randint(-64, 64, (rows, HIDDEN), generator=generator) / 16).to(torch.bfloat16)
                        for _ in range(WORLD))
        theirs[0, :5] = -0.0
        buffers[0][call % COPIES, 1, :rows] = theirs.view(torch.int16).masked_fill(theirs.view(torch.int16) == EMPTY,
                                                                                   0)
        normed, new_residual = _in_time(lambda: all_reduce_add_rms_norm(mine, residual, weight, 1e-6, ranks))
        expected = fused_add_rms_norm(mine + theirs, residual, weight, 1e-6)
        assert torch.equal(normed, expected[0]) and torch.equal(new_residual, expected[1]), f"call {call}"
        assert torch.equal(buffers[1][call % COPIES, 0, :rows], mine.view(torch.int16)), "row not pushed to rank 1"
        assert (buffers[0][(call - 1) % COPIES] == EMPTY).all(), "the last call's copy was not emptied"
        residual = new_residual
    assert epochs.tolist() == [4 % COPIES] * rows + [0] * (MAX_ROWS - rows), "the count is kept modulo the copies"


def test_the_first_norm_sums_the_embeddings_partial_rows_with_no_residual():
    """The first layer's norm over the vocabulary-parallel embedding (residual None): each token's row is on one rank
    and zeros on the other, so the sum is that row, and the residual stream starts as it."""
    from fasterllm.kernels.rms_norm import rms_norm

    generator = torch.Generator().manual_seed(11)
    buffers = [torch.full((COPIES, WORLD, MAX_ROWS, HIDDEN), EMPTY, dtype=torch.int16) for _ in range(WORLD)]
    ranks = RankBuffers(torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64),
                        torch.zeros(MAX_ROWS, dtype=torch.int32), 0, WORLD)
    weight = (torch.rand(HIDDEN, generator=generator) + 0.5).to(torch.bfloat16)
    rows = (torch.randint(-64, 64, (2, HIDDEN), generator=generator) / 16).to(torch.bfloat16)
    mine, theirs = rows.clone(), torch.zeros_like(rows)  # token 0 on this rank, token 1 on the other
    mine[1], theirs[1] = 0.0, rows[1]
    buffers[0][1, 1, :2] = theirs.view(torch.int16)
    normed, residual = _in_time(lambda: all_reduce_add_rms_norm(mine, None, weight, 1e-6, ranks))
    assert torch.equal(residual, rows)
    assert torch.equal(normed, rms_norm(rows, weight, 1e-6))
    with pytest.raises(ValueError, match="needs x, residual or both"):
        all_reduce_add_rms_norm(None, None, weight, 1e-6, ranks)


def test_a_product_that_pushes_its_row_gives_what_the_all_reduce_of_its_output_gives():
    """A row-parallel layer's one-row product (kernels/gemv.py) writes its row into every rank's buffer itself and
    the all-reduce launch only sums: the same rows as the product's output sent by the all-reduce launch, call after
    call (the product pushes into the copy of the call about to be made)."""
    from fasterllm.kernels.gemv import gemv

    generator = torch.Generator().manual_seed(7)
    pushed, sent = ([torch.full((COPIES, WORLD, MAX_ROWS, HIDDEN), EMPTY, dtype=torch.int16) for _ in range(WORLD)]
                    for _ in range(2))
    targets = [RankBuffers(torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64),
                           torch.zeros(MAX_ROWS, dtype=torch.int32), 0, WORLD) for buffers in (pushed, sent)]
    weight = (torch.rand(HIDDEN, generator=generator) + 0.5).to(torch.bfloat16)
    projection = (torch.randint(-8, 8, (HIDDEN, 32), generator=generator) / 8).to(torch.bfloat16)
    residual = (torch.randint(-64, 64, (1, HIDDEN), generator=generator) / 16).to(torch.bfloat16)
    for call in range(1, 5):
        x = (torch.randint(-8, 8, (1, 32), generator=generator) / 8).to(torch.bfloat16)
        theirs = (torch.randint(-64, 64, (1, HIDDEN), generator=generator) / 16).to(torch.bfloat16)
        for buffers in (pushed, sent):
            buffers[0][call % COPIES, 1, :1] = theirs.view(torch.int16)
        assert gemv(x, projection, push_to=targets[0]) is None
        via_push = _in_time(lambda: all_reduce_add_rms_norm(None, residual, weight, 1e-6, targets[0]))
        via_output = _in_time(lambda: all_reduce_add_rms_norm(gemv(x, projection), residual, weight, 1e-6,
                                                              targets[1]))
        assert all(torch.equal(a, b) for a, b in zip(via_push, via_output)), f"call {call}"
        assert torch.equal(pushed[1], sent[1]), f"call {call}: rank 1 was sent another row"
        residual = via_push[1]
