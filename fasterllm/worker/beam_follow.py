"""A lookahead step's beam searches, following the selection of the step in flight before the host has read it.

With asynchronous scheduling the next step is launched while the step before it still runs; a beam search's next
inputs are that step's selection, so its slots take them on the device, from the selection's tensors (worker/
beam_search.py's select: slot parents, slot tokens, slot scores, ranking): each slot's input is its token; its table
becomes its parent's (the parent's full blocks) with its own block for the new position, into which a moved slot's
parent's partly filled block is copied first (none at a block boundary: the blocks are full); and this step's
selection ranks the slots by the selection's scores. The engine reorders its copy of the tables the same way when it
reads the selection, without queueing the copies (engine/beam_blocks.py), and sends them as table changes: the
worker's own tables are the ones before the selection until then, which is what the gathers here start from.

On a GPU all of it is a few gathers and one copy launch (kernels/block_copy.py); on the CPU the host reads the
selection (it is there already) and applies it to the step's lists.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fasterllm.kernels.block_copy import copy_blocks_on_host, copy_flagged_blocks
from fasterllm.worker.input_buffers import host_to_device


@dataclass
class PreviousSelection:
    """The last step's selection on the device: [6, searches, width] ints and [2, searches, width] floats (select's
    layout) and each search's row."""
    rows: dict[str, int]
    ints: torch.Tensor
    floats: torch.Tensor

    @property
    def width(self) -> int:
        return self.ints.shape[2]


@dataclass
class FollowingSlots:
    """One entry per slot of the step's following searches (a decode row: one token): its token row, its sequence
    row, the sequence row of its search's slot 0, the flat index of its search's row and its slot in the previous
    selection's [searches, width] tensors, its slot, the table column of the position it computes, and whether that
    position is past a block's start (a moved slot copies its parent's partly filled block)."""
    token_rows: list[int] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    bases: list[int] = field(default_factory=list)
    previous: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    columns: list[int] = field(default_factory=list)
    partial: list[int] = field(default_factory=list)

    def add(self, first_token: int, first_row: int, previous_row: int, previous_width: int, width: int, start: int,
            block_size: int) -> None:
        """A following search: its slots are token rows first_token.., sequence rows first_row.., computing
        position start."""
        self.token_rows.extend(range(first_token, first_token + width))
        self.rows.extend(range(first_row, first_row + width))
        self.bases.extend([first_row] * width)
        self.previous.extend(range(previous_row * previous_width, previous_row * previous_width + width))
        self.slots.extend(range(width))
        self.columns.extend([start // block_size] * width)
        self.partial.extend([int(start % block_size != 0)] * width)


def follow_on_device(slots: FollowingSlots, previous: PreviousSelection, input_ids: torch.Tensor,
                     tables: torch.Tensor, caches: torch.Tensor) -> None:
    """Staged inputs and tables (the worker's, from before the selection) made to follow it, and the blocks copied."""
    plan = host_to_device([slots.token_rows, slots.rows, slots.bases, slots.previous, slots.slots, slots.columns,
                           slots.partial], torch.long, tables.device)
    token_rows, rows, bases, flat, slot, columns, partial = plan
    parents = previous.ints[3].reshape(-1)[flat]
    input_ids[token_rows] = previous.ints[4].reshape(-1)[flat]
    entries = torch.arange(len(slots.rows), device=tables.device)
    own = tables[rows, columns]
    taken = tables[bases + parents]  # gathered before any row is written: a slot may be another's parent
    sources = taken[entries, columns]
    taken[entries, columns] = own
    tables[rows] = taken
    copy_flagged_blocks(caches, sources, own, ((partial != 0) & (parents != slot)).to(torch.int32))


def follow_on_host(slots: FollowingSlots, previous: PreviousSelection, token_ids: list[int],
                   tables: list[list[int]], caches: torch.Tensor) -> None:
    """The same on the CPU, on the step's lists (tables: each row's list, replaced, not changed in place)."""
    parents = previous.ints[3].reshape(-1)[slots.previous].tolist()
    tokens = previous.ints[4].reshape(-1)[slots.previous].tolist()
    staged = {row: tables[row] for row in slots.rows}
    copies = []
    for token_row, row, base, parent, slot, column, partial, token in zip(
            slots.token_rows, slots.rows, slots.bases, parents, slots.slots, slots.columns, slots.partial, tokens):
        token_ids[token_row] = token
        parent_table, own = staged[base + parent], staged[row][column]
        tables[row] = parent_table[:column] + [own] + parent_table[column + 1:]
        if partial and parent != slot:
            copies.append((parent_table[column], own))
    copy_blocks_on_host(caches, copies)


def follow_selection_inputs(entries: list[list[int]], previous: PreviousSelection, ints: torch.Tensor,
                            scores: torch.Tensor) -> None:
    """This step's selection inputs (worker/beam_search.py's SelectionInputs, on the device) of the following
    searches, from the previous selection: entries [5, n] per (search, rank): its flat index in ints of the rank's
    logits row and of its slot, in scores of its score, its search's first logits row, and the flat index of the
    rank in the previous selection."""
    plan = host_to_device(entries, torch.long, ints.device)
    index_at, order_at, score_at, first_logits_row, ranked = plan
    slot = previous.ints[5].reshape(-1)[ranked]
    flat_ints = ints.view(-1)
    flat_ints[index_at] = first_logits_row + slot
    flat_ints[order_at] = slot
    scores.view(-1)[score_at] = previous.floats[1].reshape(-1)[ranked - ranked % previous.width + slot]
