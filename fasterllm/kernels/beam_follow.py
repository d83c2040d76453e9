"""A lookahead step's following beam searches made to follow the previous selection on the device, one program per
search (Triton; worker/beam_follow.py says what following means): each slot's input id becomes its selected token and
its table row its parent's with the slot's own block at the computing column; the blocks a moved slot must copy are
written out for kernels/block_copy.py's flagged copy. As torch ops this was about a dozen indexing launches a step,
each with its host dispatch (0.7 ms of the host a step for 64 searches of width 4 on an H200).

A search's slots read only its own rows, so programs never meet; within a program every row is read before any is
written (a slot may be another's parent), a barrier between them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

PLAN_ROWS = 7  # first token row, first sequence row, previous selection's flat start, width, column, partial, entry
_COLUMNS = 128  # table columns a pass


# the counts change from step to step: compiled once for any (Triton would otherwise compile a variant for a count of 1
# and for multiples of 16, each compile holding up the step that meets it)
@triton.jit(do_not_specialize=["num_searches", "previous_field"])
def _follow_kernel(plan_ptr, num_searches, previous_ptr, previous_field, input_ids_ptr, tables_ptr, table_stride,
                   num_columns, sources_ptr, destinations_ptr, flags_ptr, WIDTH: tl.constexpr,
                   COLUMNS: tl.constexpr):
    search = tl.program_id(0)
    first_token = tl.load(plan_ptr + search)
    base = tl.load(plan_ptr + num_searches + search)
    previous_start = tl.load(plan_ptr + 2 * num_searches + search)
    width = tl.load(plan_ptr + 3 * num_searches + search)
    column = tl.load(plan_ptr + 4 * num_searches + search)
    partial = tl.load(plan_ptr + 5 * num_searches + search)
    entry = tl.load(plan_ptr + 6 * num_searches + search)
    slot = tl.arange(0, WIDTH)
    ok = slot < width
    # select's [6, searches, width] ints: field 3 the slot parents, 4 the slot tokens
    parent = tl.load(previous_ptr + 3 * previous_field + previous_start + slot, mask=ok, other=0)
    token = tl.load(previous_ptr + 4 * previous_field + previous_start + slot, mask=ok, other=0)
    tl.store(input_ids_ptr + first_token + slot, token.to(input_ids_ptr.dtype.element_ty), mask=ok)
    own_rows = tables_ptr + (base + slot).to(tl.int64) * table_stride
    parent_rows = tables_ptr + (base + parent).to(tl.int64) * table_stride
    own = tl.load(own_rows + column, mask=ok, other=0)
    tl.store(sources_ptr + entry + slot, tl.load(parent_rows + column, mask=ok, other=0), mask=ok)
    tl.store(destinations_ptr + entry + slot, own, mask=ok)
    tl.store(flags_ptr + entry + slot, ((partial != 0) & (parent != slot)).to(tl.int32), mask=ok)
    for start in range(0, num_columns, COLUMNS):
        columns = start + tl.arange(0, COLUMNS)
        mask = ok[:, None] & (columns < num_columns)[None, :]
        taken = tl.load(parent_rows[:, None] + columns[None, :], mask=mask, other=0)
        tl.debug_barrier()  # every row of this pass read before any is written
        taken = tl.where(columns[None, :] == column, own[:, None], taken)
        tl.store(own_rows[:, None] + columns[None, :], taken, mask=mask)


def follow_tables(plan: torch.Tensor, previous_ints: torch.Tensor, input_ids: torch.Tensor, tables: torch.Tensor,
                  num_entries: int, max_width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """plan [PLAN_ROWS, searches] int64 (per following search: its first token row, first sequence row, flat start of
    its row in the previous selection's [searches, width] fields, width, computing table column, whether the
    computing position is past a block's start, first entry); previous_ints: select's [6, searches, width]; tables
    [rows, columns] int32 with contiguous rows. Writes input_ids and tables in place; returns (source block,
    destination block, copy flag) per entry (slot after slot) for copy_flagged_blocks."""
    if plan.shape[0] != PLAN_ROWS or not plan.is_contiguous() or not previous_ints.is_contiguous() \
            or tables.stride(1) != 1 or input_ids.dim() != 1 or input_ids.stride(0) != 1:
        raise ValueError(f"plan must be a contiguous [{PLAN_ROWS}, searches] tensor (got {tuple(plan.shape)}), the "
                         "previous selection and input_ids contiguous and the tables' rows contiguous")
    sources, destinations, flags = (torch.empty(num_entries, dtype=torch.int32, device=tables.device)
                                    for _ in range(3))
    num_searches = plan.shape[1]
    if num_searches:
        _follow_kernel[(num_searches,)](
            plan, num_searches, previous_ints, previous_ints[0].numel(), input_ids, tables, tables.stride(0),
            tables.shape[1], sources, destinations, flags, WIDTH=triton.next_power_of_2(max_width),
            COLUMNS=min(_COLUMNS, triton.next_power_of_2(tables.shape[1])))
    return sources, destinations, flags


@triton.jit(do_not_specialize=["num_entries", "previous_field", "previous_width"])
def _follow_selection_inputs_kernel(entries_ptr, num_entries, previous_ints_ptr, previous_floats_ptr, previous_field,
                                    previous_width, ints_ptr, scores_ptr, BLOCK: tl.constexpr):
    entry = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = entry < num_entries
    index_at = tl.load(entries_ptr + entry, mask=ok, other=0)
    order_at = tl.load(entries_ptr + num_entries + entry, mask=ok, other=0)
    score_at = tl.load(entries_ptr + 2 * num_entries + entry, mask=ok, other=0)
    first_logits_row = tl.load(entries_ptr + 3 * num_entries + entry, mask=ok, other=0)
    ranked = tl.load(entries_ptr + 4 * num_entries + entry, mask=ok, other=0)
    slot = tl.load(previous_ints_ptr + 5 * previous_field + ranked, mask=ok, other=0)  # field 5: the ranking
    tl.store(ints_ptr + index_at, first_logits_row + slot, mask=ok)
    tl.store(ints_ptr + order_at, slot, mask=ok)
    # floats field 1: the slot scores, of the ranked entry's own search row
    score = tl.load(previous_floats_ptr + previous_field + ranked - ranked % previous_width + slot, mask=ok, other=0.0)
    tl.store(scores_ptr + score_at, score, mask=ok)


def follow_selection_entries(entries: torch.Tensor, previous_ints: torch.Tensor, previous_floats: torch.Tensor,
                            ints: torch.Tensor, scores: torch.Tensor) -> None:
    """worker/beam_follow.follow_selection_inputs in one launch: entries [5, n] int64 (per following (search, rank):
    the flat index in ints of its logits row and of its slot, in scores of its score, its search's first logits row,
    the flat index of the rank in the previous selection); previous_ints / previous_floats: select's [6 | 2,
    searches, width]; ints (int64) and scores (fp32) contiguous, written in place."""
    if entries.shape[0] != 5 or not all(t.is_contiguous() for t in (entries, previous_ints, previous_floats, ints,
                                                                     scores)):
        raise ValueError(f"entries must be a contiguous [5, n] tensor (got {tuple(entries.shape)}) and the selection "
                         "tensors contiguous")
    num_entries, block = entries.shape[1], 256
    if num_entries:
        _follow_selection_inputs_kernel[(triton.cdiv(num_entries, block),)](
            entries, num_entries, previous_ints, previous_floats, previous_ints[0].numel(), previous_ints.shape[2],
            ints, scores, BLOCK=block)
