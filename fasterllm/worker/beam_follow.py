"""A lookahead step's beam searches, following the selection of the step in flight before the host has read it.

With asynchronous scheduling the next step is launched while the step before it still runs; a beam search's next
inputs are that step's selection, so its slots take them on the device, from the selection's tensors (worker/
beam_search.py's select: slot parents, slot tokens, slot scores, ranking): each slot's input is its token; its table
becomes its parent's (the parent's full blocks) with its own block for the new position, into which a moved slot's
parent's partly filled block is copied first (none at a block boundary: the blocks are full); and this step's
selection ranks the slots by the selection's scores. The engine reorders its copy of the tables the same way when it
reads the selection, without queueing the copies (engine/beam_blocks.py), and sends them as table changes: the
worker's own tables are the ones before the selection until then, which is what the launches here start from.

On a GPU all of it is two launches (kernels/beam_follow.py, then kernels/block_copy.py's copy); on the CPU the host
reads the selection (it is there already) and applies it to the step's lists.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from fasterllm.kernels.beam_follow import follow_selection_entries, follow_tables
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
    """One entry per following search of the step (its slots are decode rows: one token each): its first token row,
    its first sequence row (its slot 0's), the flat index of its row in the previous selection's [searches, width]
    tensors, its width, the table column of the position it computes, and whether that position is past a block's start
    (a moved slot copies its parent's partly filled block)."""
    first_tokens: list[int] = field(default_factory=list)
    first_rows: list[int] = field(default_factory=list)
    previous_starts: list[int] = field(default_factory=list)
    widths: list[int] = field(default_factory=list)
    columns: list[int] = field(default_factory=list)
    partial: list[int] = field(default_factory=list)

    def add(self, first_token: int, first_row: int, previous_row: int, previous_width: int, width: int, start: int,
            block_size: int) -> None:
        """A following search: its slots are token rows first_token.., sequence rows first_row.., computing
        position start."""
        self.first_tokens.append(first_token)
        self.first_rows.append(first_row)
        self.previous_starts.append(previous_row * previous_width)
        self.widths.append(width)
        self.columns.append(start // block_size)
        self.partial.append(int(start % block_size != 0))

    @property
    def num_slots(self) -> int:
        return sum(self.widths)

    def plan(self) -> list[list[int]]:
        """kernels/beam_follow.py's plan rows: the entries above and each search's first slot among all of them."""
        return [self.first_tokens, self.first_rows, self.previous_starts, self.widths, self.columns, self.partial,
                [0, *itertools.accumulate(self.widths)][:-1]]


def follow_on_device(slots: FollowingSlots, previous: PreviousSelection, input_ids: torch.Tensor,
                     tables: torch.Tensor, caches: torch.Tensor) -> None:
    """Staged inputs and tables (the worker's, from before the selection) made to follow it, and the blocks copied:
    two launches."""
    plan = host_to_device(slots.plan(), torch.long, tables.device)
    copies = follow_tables(plan, previous.ints, input_ids, tables, slots.num_slots, max(slots.widths))
    copy_flagged_blocks(caches, *copies)


def follow_on_host(slots: FollowingSlots, previous: PreviousSelection, token_ids: list[int],
                   tables: list[list[int]], caches: torch.Tensor) -> None:
    """The same on the CPU, on the step's lists (tables: each row's list, replaced, not changed in place)."""
    parents, tokens = previous.ints[3].reshape(-1).tolist(), previous.ints[4].reshape(-1).tolist()
    copies = []
    for first_token, base, previous_start, width, column, partial in zip(
            slots.first_tokens, slots.first_rows, slots.previous_starts, slots.widths, slots.columns, slots.partial):
        staged = tables[base:base + width]  # a slot may be another's parent: every row read before any is replaced
        for slot in range(width):
            parent = parents[previous_start + slot]
            token_ids[first_token + slot] = tokens[previous_start + slot]
            parent_table, own = staged[parent], staged[slot][column]
            tables[base + slot] = parent_table[:column] + [own] + parent_table[column + 1:]
            if partial and parent != slot:
                copies.append((parent_table[column], own))
    copy_blocks_on_host(caches, copies)


def follow_selection_inputs(entries: list[list[int]], previous: PreviousSelection, ints: torch.Tensor,
                            scores: torch.Tensor) -> None:
    """This step's selection inputs (worker/beam_search.py's SelectionInputs, on the device) of the following
    searches, from the previous selection: entries [5, n] per (search, rank): its flat index in ints of the rank's
    logits row and of its slot, in scores of its score, its search's first logits row, and the flat index of the
    rank in the previous selection (kernels/beam_follow.py's one launch)."""
    follow_selection_entries(host_to_device(entries, torch.long, ints.device), previous.ints, previous.floats, ints,
                             scores)
