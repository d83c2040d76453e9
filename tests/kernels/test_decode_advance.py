"""A decode batch's inputs moved on by one token in one launch, against the same computed in torch: in Triton's
interpreter on a CPU, natively on a GPU."""
from __future__ import annotations

import pytest
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytest.importorskip("triton")
from fasterllm.kernels.decode_advance import advance_decode_inputs  # noqa: E402

BLOCK = 16


def buffers(rows: int, width: int, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, BLOCK * (width - 1), (rows,), generator=generator)
    return {"positions": positions.to(DEVICE), "seq_lens": (positions + 1).int().to(DEVICE),
            "slot_mapping": torch.full((rows,), -7, dtype=torch.long, device=DEVICE),
            "block_tables": torch.randint(0, 1000, (rows, width), generator=generator).int().to(DEVICE),
            "input_ids": torch.full((rows,), 5, dtype=torch.long, device=DEVICE)}


@pytest.mark.parametrize("num_rows, with_samples", [(3, False), (3, True), (300, True)])
def test_the_first_rows_move_on_and_the_rest_stay(num_rows, with_samples):
    rows = num_rows + 5  # the graph's padding rows below the batch: untouched
    got, want = buffers(rows, 8, seed=num_rows), buffers(rows, 8, seed=num_rows)
    samples = torch.arange(100, 100 + num_rows, device=DEVICE) if with_samples else None
    advance_decode_inputs(got["positions"], got["seq_lens"], got["slot_mapping"], got["block_tables"], BLOCK,
                          num_rows, *((got["input_ids"], samples) if with_samples else ()))
    batch = slice(0, num_rows)
    want["positions"][batch] += 1
    want["seq_lens"][batch] += 1
    position = want["positions"][batch]
    blocks = want["block_tables"][batch].gather(1, (position // BLOCK)[:, None]).squeeze(1).long()
    want["slot_mapping"][batch] = blocks * BLOCK + position % BLOCK
    if with_samples:
        want["input_ids"][batch] = samples
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_ids_without_samples_are_refused():
    b = buffers(2, 4, seed=0)
    with pytest.raises(ValueError, match="input_ids and samples together"):
        advance_decode_inputs(b["positions"], b["seq_lens"], b["slot_mapping"], b["block_tables"], BLOCK, 2,
                              b["input_ids"])
