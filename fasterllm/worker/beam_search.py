"""The worker's part of beam search: the rows of a step's searches, and one selection over all of them at once.

A search keeps width slots for its whole life, each a row with its own block table (the engine reorders the
tables after each selection: engine/beam_blocks.py). The selection runs on the device for every search of the step
in a fixed number of tensor operations, as transformers' beam search does for a batch: the top candidates over
slots x vocabulary by cumulative logprob, eos candidates set apart, the best width live ones given the slots, a
parent's best continuation in the parent's own slot (so its last, partly filled block needs no copy). Every
tensor-parallel rank selects from the same all-gathered logits with the same operations, so all select alike.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fasterllm.worker.beam_follow import FollowingSlots, PreviousSelection, follow_selection_inputs
from fasterllm.worker.input_buffers import host_tensor
from fasterllm.worker.step_messages import NewSearchData, SearchChunks, SearchSelection


@dataclass
class SearchState:
    """The worker's copy of a search: what its selection needs and each slot's block table."""
    width: int
    num_candidates: int
    eos_token_ids: list[int]
    encoder_token_ids: list[int] | None
    slot_tables: list[list[int]]
    cross_block_table: list[int] | None = None

    @staticmethod
    def new(data: NewSearchData) -> SearchState:
        return SearchState(data.width, data.num_candidates, data.eos_token_ids, data.encoder_token_ids,
                           [[] for _ in range(data.width)])

    def apply(self, changes: list[tuple[int, int, list[int]]]) -> None:
        for slot, start, tail in changes:
            table = self.slot_tables[slot]
            del table[start:]
            table.extend(tail)


@dataclass
class SearchRows:
    """Where the step's search rows went: the searches whose chunk starts at token 0 (their encoders run), per
    selecting search the token row of each computing slot's last token (its logits rows, slot after slot), and the
    slots that follow the previous step's selection on the device (worker/beam_follow.py)."""
    starting: list[SearchState]
    logits_rows: list[int]
    following: FollowingSlots


def stage_search_rows(chunks: SearchChunks, searches: dict[str, SearchState], token_ids: list[int],
                      query_lens: list[int], seq_lens: list[int], tables: list[list[int]],
                      cross: tuple[list[int], list[list[int]]] | None, previous: PreviousSelection | None,
                      block_size: int) -> SearchRows:
    """Append every computing slot of the step's searches as a sequence of its own (after the requests' ones)."""
    rows = SearchRows([], [], FollowingSlots())
    for search_id, start, num_new, num_slots, inputs, selects, follows in zip(
            chunks.search_ids, chunks.starts, chunks.num_new_tokens, chunks.num_slots, chunks.token_ids,
            chunks.selects, chunks.follows):
        state = searches[search_id]
        if start == 0:
            rows.starting.append(state)
        first = len(token_ids)
        if follows:
            rows.following.add(first, len(query_lens), _previous_row(previous, search_id), previous.width, num_slots,
                               start, block_size)
        token_ids.extend(inputs)
        query_lens.extend([num_new] * num_slots)
        seq_lens.extend([start + num_new] * num_slots)
        tables.extend(state.slot_tables[:num_slots])
        if cross is not None:
            cross[0].extend([len(state.encoder_token_ids)] * num_slots)
            cross[1].extend([state.cross_block_table] * num_slots)
        if selects:
            rows.logits_rows.extend(first + num_new * (slot + 1) - 1 for slot in range(num_slots))
    return rows


@dataclass
class SelectionInputs:
    """The host's part of a step's selection, for the searches that select: per search one row of ints (the logits
    row of each of the widest width's slots in rank order (pad_row: no beam), the slots in rank order, its eos ids
    padded with -1, its width, its number of candidates) and one of floats (each slot's score in rank order)."""
    search_ids: list[str]
    width: int  # the widest search's
    num_candidates: int  # the most candidates a search asks
    num_eos: int  # the most eos ids a search has (at least 1)
    ints: list[list[int]]
    scores: list[list[float]]
    follow: list[list[int]] | None = None  # following searches' entries (beam_follow.follow_selection_inputs)

    def to_device(self, ints: torch.Tensor, scores: torch.Tensor, previous: PreviousSelection | None) -> None:
        """Into the selection's input tensors on the device, and the following searches' from the previous
        selection."""
        for tensor, rows in ((ints, self.ints), (scores, self.scores)):
            tensor.copy_(host_tensor(rows, tensor.dtype, pin=tensor.is_cuda), non_blocking=True)
        if self.follow is not None:
            follow_selection_inputs(self.follow, previous, ints, scores)

    def pad(self, num_searches: int, pad_row: int) -> None:
        """Add searches up to num_searches that select nothing (no beam, width 0)."""
        missing = num_searches - len(self.ints)
        self.ints += [[pad_row] * self.width + list(range(self.width)) + [-1] * self.num_eos + [0, 0]] * missing
        self.scores += [[float("-inf")] * self.width] * missing


def _previous_row(previous: PreviousSelection | None, search_id: str) -> int:
    if previous is None or search_id not in previous.rows:
        raise RuntimeError(f"search {search_id!r} follows a selection this worker did not make: the step before it "
                           "did not select for it")
    return previous.rows[search_id]


def selection_inputs(chunks: SearchChunks, searches: dict[str, SearchState], pad_row: int,
                     previous: PreviousSelection | None) -> SelectionInputs:
    """pad_row: the index one past the last logits row (the selection appends a row of -inf there). A following
    search's ranking and scores are placeholders here, and entries in `follow` say where the previous selection's go
    (beam_follow.follow_selection_inputs)."""
    picked = [i for i, selects in enumerate(chunks.selects) if selects]
    states = [searches[chunks.search_ids[i]] for i in picked]
    width = max(state.width for state in states)
    num_eos = max(1, max(len(state.eos_token_ids) for state in states))
    num_columns = 2 * width + num_eos + 2
    ints, scores, row = [], [], 0
    follow: list[list[int]] = [[], [], [], [], []]
    for i, state in zip(picked, states):
        slot_order, slot_scores, num_slots = chunks.order[i], chunks.scores[i], chunks.num_slots[i]
        if chunks.follows[i]:  # per rank: where its logits row, slot and score go, and where it was ranked
            at, ranked, count = len(ints) * num_columns, _previous_row(previous, chunks.search_ids[i]), state.width
            for values, first in zip(follow, (at, at + width, len(ints) * width, None, ranked * previous.width)):
                values.extend([row] * count if first is None else range(first, first + count))
        padding = width - state.width
        ints.append([row + slot if slot < num_slots else pad_row for slot in slot_order] + [pad_row] * padding
                    + slot_order + list(range(state.width, width))
                    + state.eos_token_ids + [-1] * (num_eos - len(state.eos_token_ids))
                    + [state.width, state.num_candidates])
        scores.append([slot_scores[slot] for slot in slot_order] + [float("-inf")] * padding)
        row += num_slots
    return SelectionInputs([chunks.search_ids[i] for i in picked], width,
                           max(state.num_candidates for state in states), num_eos, ints, scores,
                           follow if follow[0] else None)


def select(logits: torch.Tensor, ints: torch.Tensor, scores: torch.Tensor, width: int, num_candidates: int,
           num_eos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The selection on the device, with no read back to the host (a CUDA graph can hold it). logits: [rows, V] fp32
    of the selecting searches' computing slots; ints, scores: SelectionInputs' rows. Returns ([6, searches, width]
    int64: candidate slots, candidate tokens, candidate is eos, slot parents, slot tokens, order; [2, searches,
    width] fp32: candidate scores, slot scores), as SearchSelection's fields."""
    device, vocab = logits.device, logits.shape[-1]
    num_searches = ints.shape[0]
    index, order = ints[:, :width], ints[:, width:2 * width]
    eos, widths, allowed = ints[:, 2 * width:2 * width + num_eos], ints[:, -2:-1], ints[:, -1:]
    # only a row's best num_candidates tokens can be among its search's best num_candidates: each row's are taken
    # first, so no other [rows, V] tensor than the logprobs is made
    top_logprobs, top_tokens = logits.log_softmax(dim=-1).topk(min(num_candidates, vocab), dim=-1)
    top_logprobs = torch.cat([top_logprobs, top_logprobs.new_full((1, top_logprobs.shape[1]), float("-inf"))])
    top_tokens = torch.cat([top_tokens, torch.zeros_like(top_tokens[:1])])
    # [searches, W, K]: cumulative logprob of each slot's best continuations, slots best first
    ranked = top_logprobs[index] + scores[:, :, None]
    per_slot = ranked.shape[2]
    top_scores, top = ranked.view(num_searches, width * per_slot).topk(num_candidates, dim=-1)
    tokens = top_tokens[index].view(num_searches, width * per_slot).gather(1, top)
    slots = order.gather(1, top // per_slot)
    is_eos = (tokens[:, :, None] == eos[:, None, :]).any(dim=-1)
    ranks = torch.arange(num_candidates, device=device)
    live = (ranks < allowed) & ~is_eos & top_scores.isfinite()
    chosen = live & (live.cumsum(dim=1) <= widths)
    # the chosen candidates first, best first: the live continuations
    picked_rank = torch.where(chosen, ranks, ranks + num_candidates).argsort(dim=1)[:, :width]
    parents, next_tokens = slots.gather(1, picked_rank), tokens.gather(1, picked_rank)
    next_scores = torch.where(chosen.gather(1, picked_rank), top_scores.gather(1, picked_rank), float("-inf"))
    # slots: a parent's first (best) continuation stays in the parent's slot, the others take the free slots in order
    columns = torch.arange(width, device=device)
    in_width = columns[None, :] < widths
    same_parent = parents[:, :, None] == parents[:, None, :]
    first = ~(same_parent & (columns[None, :] < columns[:, None])[None]).any(dim=-1) & in_width
    claimed = torch.zeros(num_searches, width + 1, dtype=torch.bool, device=device)
    claimed.scatter_(1, torch.where(first, parents, width), True)
    free_slots = torch.where(claimed[:, :width] | ~in_width, columns + width, columns).argsort(dim=1)
    later = ((~first & in_width).cumsum(dim=1) - 1).clamp(min=0)
    target = torch.where(first, parents, free_slots.gather(1, later))
    target = torch.where(in_width, target, width)  # padding columns land in a column that is dropped

    def by_slot(values: torch.Tensor, fill) -> torch.Tensor:
        out = torch.full((num_searches, width + 1), fill, dtype=values.dtype, device=device)
        return out.scatter_(1, target, values)[:, :width]

    ints_out = torch.stack([slots[:, :width], tokens[:, :width], is_eos[:, :width].long(), by_slot(parents, 0),
                            by_slot(next_tokens, 0), torch.where(in_width, target, columns)])
    return ints_out, torch.stack([top_scores[:, :width], by_slot(next_scores, float("-inf"))])


class PendingSelection:
    """A launched selection: on a GPU its copy to pinned host memory is queued behind it (the tensors may be a
    graph's, overwritten by its next replay); on_host() waits for it."""

    def __init__(self, search_ids: list[str], ints: torch.Tensor, floats: torch.Tensor):
        self.search_ids = search_ids
        self.on_device = PreviousSelection({search_id: row for row, search_id in enumerate(search_ids)}, ints, floats)
        self.ready = None
        if ints.is_cuda:
            self.ints = torch.empty(ints.shape, dtype=ints.dtype, pin_memory=True).copy_(ints, non_blocking=True)
            self.floats = torch.empty(floats.shape, dtype=floats.dtype, pin_memory=True).copy_(floats,
                                                                                                non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record()
        else:
            self.ints, self.floats = ints, floats

    def on_host(self) -> SearchSelection:
        if self.ready is not None:
            self.ready.synchronize()
        num = len(self.search_ids)  # a graph's padding searches follow
        ints = [rows[:num] for rows in self.ints.tolist()]
        floats = [rows[:num] for rows in self.floats.tolist()]
        return SearchSelection(self.search_ids, candidate_slots=ints[0], candidate_tokens=ints[1],
                               candidate_scores=floats[0], candidate_eos=ints[2], slot_parents=ints[3],
                               slot_tokens=ints[4], slot_scores=floats[1], order=ints[5])


def select_beams(logits: torch.Tensor, chunks: SearchChunks, searches: dict[str, SearchState],
                 previous: PreviousSelection | None) -> PendingSelection:
    """The selection launched op by op (the CPU, or a GPU without graphs): logits [rows, V] fp32 of the selecting
    searches' computing slots, search after search, slot after slot."""
    inputs = selection_inputs(chunks, searches, logits.shape[0], previous)
    ints = torch.empty(len(inputs.ints), len(inputs.ints[0]), dtype=torch.long, device=logits.device)
    scores = torch.empty(len(inputs.scores), inputs.width, dtype=torch.float32, device=logits.device)
    inputs.to_device(ints, scores, previous)
    return PendingSelection(inputs.search_ids, *select(logits, ints, scores, inputs.width, inputs.num_candidates,
                                                       inputs.num_eos))
