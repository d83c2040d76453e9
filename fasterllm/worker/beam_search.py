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

from fasterllm.worker.input_buffers import host_to_device
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
    """Where the step's search rows went: the searches whose chunk starts at token 0 (their encoders run), and per
    selecting search the token row of each computing slot's last token (its logits rows, slot after slot)."""
    starting: list[SearchState]
    logits_rows: list[int]


def stage_search_rows(chunks: SearchChunks, searches: dict[str, SearchState], token_ids: list[int],
                      query_lens: list[int], seq_lens: list[int], tables: list[list[int]],
                      cross: tuple[list[int], list[list[int]]] | None) -> SearchRows:
    """Append every computing slot of the step's searches as a sequence of its own (after the requests' ones)."""
    rows = SearchRows([], [])
    for search_id, start, num_new, num_slots, inputs, selects in zip(
            chunks.search_ids, chunks.starts, chunks.num_new_tokens, chunks.num_slots, chunks.token_ids,
            chunks.selects):
        state = searches[search_id]
        if start == 0:
            rows.starting.append(state)
        first = len(token_ids)
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


def select_beams(logits: torch.Tensor, chunks: SearchChunks,
                 searches: dict[str, SearchState]) -> tuple[list[str], dict[str, torch.Tensor]]:
    """logits: [rows, V] fp32 of the selecting searches' computing slots, search after search, slot after slot.
    Returns the selecting searches' ids and the selection's tensors (on the device), named as SearchSelection's
    fields."""
    device, vocab = logits.device, logits.shape[-1]
    picked = [i for i, selects in enumerate(chunks.selects) if selects]
    states = [searches[chunks.search_ids[i]] for i in picked]
    width = max(state.width for state in states)
    pad_row = logits.shape[0]  # a row of -inf: a slot with no beam, or past a narrower search's width
    index, scores, order, row = [], [], [], 0
    for i, state in zip(picked, states):
        slot_order, slot_scores, num_slots = chunks.order[i], chunks.scores[i], chunks.num_slots[i]
        padding = width - state.width
        index.append([row + slot if slot < num_slots else pad_row for slot in slot_order] + [pad_row] * padding)
        scores.append([slot_scores[slot] for slot in slot_order] + [float("-inf")] * padding)
        order.append(slot_order + list(range(state.width, width)))
        row += num_slots
    num_candidates = max(state.num_candidates for state in states)
    # only a row's best num_candidates tokens can be among its search's best num_candidates: each row's are taken
    # first, so no other [rows, V] tensor than the logprobs is made
    top_logprobs, top_tokens = logits.log_softmax(dim=-1).topk(min(num_candidates, vocab), dim=-1)
    top_logprobs = torch.cat([top_logprobs, top_logprobs.new_full((1, top_logprobs.shape[1]), float("-inf"))])
    top_tokens = torch.cat([top_tokens, torch.zeros_like(top_tokens[:1])])
    index_t = host_to_device(index, torch.long, device)
    ranked = top_logprobs[index_t] + host_to_device(scores, torch.float32, device)[:, :, None]
    # [searches, W, K]: cumulative logprob of each slot's best continuations, slots best first
    order_t = host_to_device(order, torch.long, device)
    per_slot = ranked.shape[2]
    top_scores, top = ranked.view(len(states), width * per_slot).topk(num_candidates, dim=-1)
    tokens = top_tokens[index_t].view(len(states), width * per_slot).gather(1, top)
    slots = order_t.gather(1, top // per_slot)
    longest_eos = max(1, max(len(state.eos_token_ids) for state in states))
    eos = host_to_device([s.eos_token_ids + [-1] * (longest_eos - len(s.eos_token_ids)) for s in states],
                         torch.long, device)
    is_eos = (tokens[:, :, None] == eos[:, None, :]).any(dim=-1)
    ranks = torch.arange(num_candidates, device=device)
    widths = host_to_device([state.width for state in states], torch.long, device)[:, None]
    allowed = host_to_device([state.num_candidates for state in states], torch.long, device)[:, None]
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
    claimed = torch.zeros(len(states), width + 1, dtype=torch.bool, device=device)
    claimed.scatter_(1, torch.where(first, parents, width), True)
    free_slots = torch.where(claimed[:, :width] | ~in_width, columns + width, columns).argsort(dim=1)
    later = ((~first & in_width).cumsum(dim=1) - 1).clamp(min=0)
    target = torch.where(first, parents, free_slots.gather(1, later))
    target = torch.where(in_width, target, width)  # padding columns land in a column that is dropped

    def by_slot(values: torch.Tensor, fill) -> torch.Tensor:
        out = torch.full((len(states), width + 1), fill, dtype=values.dtype, device=device)
        return out.scatter_(1, target, values)[:, :width]

    return [chunks.search_ids[i] for i in picked], {
        "candidate_slots": slots[:, :width], "candidate_tokens": tokens[:, :width],
        "candidate_scores": top_scores[:, :width], "candidate_eos": is_eos[:, :width],
        "slot_parents": by_slot(parents, 0), "slot_tokens": by_slot(next_tokens, 0),
        "slot_scores": by_slot(next_scores, float("-inf")), "order": torch.where(in_width, target, columns)}


def selection_on_host(search_ids: list[str], tensors: dict) -> SearchSelection:
    """The selection as host arrays (waits for the device)."""
    return SearchSelection(search_ids, **{name: tensor.cpu().numpy() for name, tensor in tensors.items()})
