"""kernels/beam_follow.py against the same steps written in Python: following searches of different widths whose slots
swap parents (a slot another's parent), tables wider than one pass of columns, positions in and at the start of a
block; and the following searches' selection inputs. Under TRITON_INTERPRET on the CPU, on the GPU where there is
one."""
from __future__ import annotations

import random

import pytest
import torch

from fasterllm.kernels.beam_follow import PLAN_ROWS, follow_selection_entries, follow_tables

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("num_columns", [3, 300])
def test_each_slot_takes_its_parents_table_and_token_and_its_own_block(num_columns):
    rng = random.Random(num_columns)
    widths, previous_width = [4, 2, 3, 1], 4
    num_previous = 6
    previous_rows = [2, 0, 5, 1]  # each search's row of the previous selection
    previous = torch.zeros(6, num_previous, previous_width, dtype=torch.long)
    previous[4] = torch.randint(0, 1000, (num_previous, previous_width))  # the slot tokens
    for width, row in zip(widths, previous_rows):  # the slot parents, among the search's own slots
        previous[3, row, :width] = torch.tensor([rng.randrange(width) for _ in range(width)])
    previous[3, previous_rows[0]] = torch.tensor([1, 0, 3, 2])  # every slot another's parent
    num_rows = 1 + sum(widths)
    tables = torch.randint(0, 10_000, (num_rows, num_columns), dtype=torch.int32)
    input_ids = torch.zeros(num_rows + 2, dtype=torch.long)
    plan, first_row, entry = [[] for _ in range(PLAN_ROWS)], 1, 0
    for width, previous_row in zip(widths, previous_rows):
        column = rng.randrange(num_columns)
        for values, value in zip(plan, (first_row + 2, first_row, previous_row * previous_width, width, column,
                                        rng.randrange(2), entry)):
            values.append(value)
        first_row, entry = first_row + width, entry + width
    expected_tables, expected_ids = tables.clone(), input_ids.clone()
    expected_copies = []
    for first_token, base, start, width, column, partial, _ in zip(*plan):
        for slot in range(width):
            parent = previous.view(6, -1)[3, start + slot].item()
            expected_ids[first_token + slot] = previous.view(6, -1)[4, start + slot]
            expected_tables[base + slot] = tables[base + parent]
            expected_tables[base + slot, column] = tables[base + slot, column]
            expected_copies.append((tables[base + parent, column].item(), tables[base + slot, column].item(),
                                    int(partial and parent != slot)))
    tables, input_ids = tables.to(DEVICE), input_ids.to(DEVICE)
    copies = follow_tables(torch.tensor(plan, device=DEVICE), previous.to(DEVICE), input_ids, tables, entry,
                           max(widths))
    assert torch.equal(input_ids.cpu(), expected_ids)
    assert torch.equal(tables.cpu(), expected_tables)
    assert list(zip(*(t.tolist() for t in copies))) == expected_copies


def test_following_selection_inputs_come_from_the_previous_ranking_and_scores():
    previous = torch.zeros(6, 2, 3, dtype=torch.long)
    previous[5] = torch.tensor([[2, 0, 1], [1, 2, 0]])  # each search's slots, best first
    floats = torch.tensor([[[0.0] * 3] * 2, [[-1.0, -2.0, -3.0], [-4.0, -5.0, -6.0]]])
    ints, scores = torch.full((2, 8), -7, dtype=torch.long, device=DEVICE), torch.zeros(2, 3, device=DEVICE)
    # search row 1 of this step follows previous row 1: ranks 0..2 at ints[1, 0..2] (logits rows from 10), ints[1,
    # 3..5] (slots), scores[1, 0..2]
    entries = torch.tensor([[8, 9, 10], [11, 12, 13], [3, 4, 5], [10, 10, 10], [3, 4, 5]])
    follow_selection_entries(entries.to(DEVICE), previous.to(DEVICE), floats.to(DEVICE), ints, scores)
    assert ints[1, :6].tolist() == [11, 12, 10, 1, 2, 0]
    assert ints[0].tolist() == [-7] * 8 and ints[1, 6:].tolist() == [-7] * 2
    assert scores[1].tolist() == [-5.0, -6.0, -4.0] and scores[0].tolist() == [0.0] * 3
