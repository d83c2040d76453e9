"""The worker's beam selection, made for every search of a step at once, against a plain per-search selection:
transformers' rule (the top candidates over slots x vocabulary, eos ones set apart, the best width live ones kept)
and the slot rule (a parent's best continuation stays in its slot, the others fill the free slots in order)."""
from __future__ import annotations

import pytest
import torch

from fasterllm.worker.beam_search import SearchState, select_beams
from fasterllm.worker.step_messages import SearchChunks

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

VOCAB = 12


def reference(logprobs: list[torch.Tensor], scores: list[float], order: list[int], width: int, num_candidates: int,
              eos: list[int]):
    """One search, by a sort in Python: (candidates [(slot, token, score, is eos)], slot parents, tokens, scores)."""
    candidates = sorted(((scores[slot] + logprobs[slot][token].item(), rank, token, slot)
                         for rank, slot in enumerate(order) if slot < len(logprobs) for token in range(VOCAB)),
                        key=lambda c: (-c[0], c[1], c[2]))[:num_candidates]
    live = [c for c in candidates if c[2] not in eos][:width]
    taken, parents, tokens, new_scores = set(), [None] * width, [None] * width, [None] * width
    later = []
    for score, _, token, slot in live:  # a parent's first (best) continuation takes the parent's slot
        if slot in taken:
            later.append((slot, token, score))
        else:
            taken.add(slot)
            parents[slot], tokens[slot], new_scores[slot] = slot, token, score
    free = [slot for slot in range(width) if slot not in taken]
    for target, (slot, token, score) in zip(free, later):
        parents[target], tokens[target], new_scores[target] = slot, token, score
    return ([(slot, token, score, token in eos) for score, _, token, slot in candidates[:width]],
            parents, tokens, new_scores)


def graph_select(logits, chunks, states, previous):
    from fasterllm.worker.beam_selection_graphs import SelectionGraphs
    graphs = SelectionGraphs(torch.device("cuda"))
    graphs.select(logits, chunks, states, previous).on_host()  # captured on the first call: check a replay's
    return graphs.select(logits, chunks, states, previous)


@pytest.mark.parametrize("num_searches", [4, 3])  # a graph's 3 searches pad to 4
@pytest.mark.parametrize("device, selector", [
    ("cpu", select_beams), pytest.param("cuda", select_beams, marks=GPU),
    pytest.param("cuda", graph_select, marks=GPU)])
def test_one_selection_over_searches_of_different_widths_matches_each_search_alone(device, selector,
                                                                                        num_searches):
    torch.manual_seed(0)
    # (width, eos ids, computing slots, slot scores, ranking): a first step (slot 0 alone), a wide search with two
    # eos ids, a narrow one without eos (ignore_eos), and a search whose ranking is not slot order
    searches = [(3, [1], 1, [0.0, float("-inf"), float("-inf")], [0, 1, 2]),
                (4, [1, 2], 4, [-1.0, -1.5, -2.0, -2.2], [0, 1, 2, 3]),
                (2, [], 2, [-0.5, -0.7], [0, 1]),
                (4, [3], 4, [-2.0, -1.0, -3.0, -1.5], [1, 3, 0, 2])][:num_searches]
    chunks = SearchChunks()
    states, rows = {}, []
    for index, (width, eos, num_slots, scores, order) in enumerate(searches):
        search_id = f"s{index}"
        states[search_id] = SearchState(width, max(2, 1 + len(eos)) * width, eos, None, [[] for _ in range(width)])
        chunks.search_ids.append(search_id)
        chunks.num_slots.append(num_slots)
        chunks.selects.append(True)
        chunks.follows.append(False)
        chunks.scores.append(scores)
        chunks.order.append(order)
        rows.append(torch.randn(num_slots, VOCAB) * 3)
    # a token that ends every slot's best continuation: eos candidates must be set apart, not kept live
    rows[1][:, 1] = 10.0
    got = selector(torch.cat(rows).to(device), chunks, states, None).on_host()
    assert got.search_ids == chunks.search_ids
    for index, (width, eos, num_slots, scores, order) in enumerate(searches):
        logprobs = list(rows[index].log_softmax(dim=-1))
        candidates, parents, tokens, new_scores = reference(logprobs, scores, order, width,
                                                            states[f"s{index}"].num_candidates, eos)
        assert got.candidate_slots[index][:width] == [c[0] for c in candidates]
        assert got.candidate_tokens[index][:width] == [c[1] for c in candidates]
        assert got.candidate_eos[index][:width] == [c[3] for c in candidates]
        torch.testing.assert_close(got.candidate_scores[index][:width], [c[2] for c in candidates])
        assert got.slot_parents[index][:width] == parents
        assert got.slot_tokens[index][:width] == tokens
        torch.testing.assert_close(got.slot_scores[index][:width], new_scores)
        # the slots best first: by score
        ranking = got.order[index][:width]
        assert sorted(ranking) == list(range(width))
        assert [new_scores[slot] for slot in ranking] == sorted(new_scores, reverse=True)
    assert any(got.candidate_eos[1][:4])  # the eos case was exercised
    assert got.slot_parents[0][:3] == [0, 0, 0]  # the first step continues slot 0 only
