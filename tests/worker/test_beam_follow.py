"""A lookahead step's beam slots following the previous selection: the device path (kernels/beam_follow.py's launches
and the flagged block copy: on the GPU where there is one, else under TRITON_INTERPRET on CPU tensors) gives what the
host path gives, and the selection inputs filled from the previous selection equal those built on the host from its
values."""
from __future__ import annotations

import torch

from fasterllm.worker.beam_follow import FollowingSlots, PreviousSelection, follow_on_device, follow_on_host
from fasterllm.worker.beam_search import SearchState, selection_inputs
from fasterllm.worker.step_messages import SearchChunks

BLOCK = 4
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the Triton launches: the interpreter runs them on the CPU


def previous_selection(device: str = "cpu") -> PreviousSelection:
    """Two searches of width 4 (rows 0 and 1 of the selection): parents, tokens, ranking by slot, and scores."""
    parents = [[0, 0, 2, 0], [0, 1, 2, 3]]  # search "a": slots 1 and 3 continue slot 0's beam; "b" keeps its slots
    tokens = [[11, 12, 13, 14], [21, 22, 23, 24]]
    order = [[0, 3, 1, 2], [3, 2, 1, 0]]
    ints = torch.tensor([[[0] * 4] * 2, [[0] * 4] * 2, [[0] * 4] * 2, parents, tokens, order])
    floats = torch.tensor([[[0.0] * 4] * 2, [[-1.0, -2.5, -3.0, -1.5], [-4.0, -3.0, -2.0, -1.0]]])
    return PreviousSelection({"a": 0, "b": 1}, ints.to(device), floats.to(device))


def test_the_device_path_gives_what_the_host_path_gives():
    device = DEVICE
    torch.manual_seed(0)
    # a request's 3-token chunk in row 0, then "a" at position 6 (a partly filled block: moved slots copy it), then
    # "b" at position 8 (a block boundary: each slot's new block is its own, nothing copied)
    slots = FollowingSlots()
    slots.add(3, 1, 0, 4, 4, 6, BLOCK)
    slots.add(7, 5, 1, 4, 4, 8, BLOCK)
    tables = [[30, 31]] + [[1, 2], [3, 4], [5, 6], [7, 8]] + [[9, 10, 20], [11, 12, 21], [13, 14, 22], [15, 16, 23]]
    token_ids = [5, 6, 7] + [0] * 8
    caches = torch.randn(2, 2, 40, BLOCK, 1, 2)
    host_tables, host_tokens, host_caches = list(tables), list(token_ids), caches.clone()
    follow_on_host(slots, previous_selection(), host_tokens, host_tables, host_caches)
    assert host_tables[1:5] == [[1, 2], [1, 4], [5, 6], [1, 8]]  # "a": slot 0's full block, each slot's own last
    assert host_tables[5:] == tables[5:]  # "b": every slot its own parent
    assert torch.equal(host_caches[:, :, 4], caches[:, :, 2]) and torch.equal(host_caches[:, :, 8], caches[:, :, 2])
    assert torch.equal(host_caches[:, :, 6], caches[:, :, 6])
    width = max(map(len, tables))
    device_tables = torch.tensor([table + [-1] * (width - len(table)) for table in tables], dtype=torch.int32,
                                 device=device)
    device_tokens, device_caches = torch.tensor(token_ids, device=device), caches.to(device)
    follow_on_device(slots, previous_selection(device), device_tokens, device_tables, device_caches)
    assert device_tokens.tolist() == host_tokens == [5, 6, 7, 11, 12, 13, 14, 21, 22, 23, 24]
    assert [row[:len(table)] for row, table in zip(device_tables.tolist(), host_tables)] == host_tables
    assert torch.equal(device_caches.cpu(), host_caches)


def test_selection_inputs_from_the_previous_selection_equal_the_host_built_ones():
    previous = previous_selection(DEVICE)
    states = {"a": SearchState(4, 8, [2], None, [[]] * 4), "c": SearchState(2, 6, [2, 5], None, [[]] * 2),
              "b": SearchState(4, 8, [2], None, [[]] * 4)}
    order, scores = previous.ints[5].tolist(), previous.floats[1].tolist()  # read back: the host path's values

    def chunks(follows: bool) -> SearchChunks:
        out = SearchChunks()
        for search_id, num_slots, row in (("a", 4, 0), ("c", 2, None), ("b", 4, 1)):
            out.search_ids.append(search_id)
            out.num_slots.append(num_slots)
            out.selects.append(True)
            following = follows and row is not None
            out.follows.append(following)
            out.order.append([0] * num_slots if following else (order[row] if row is not None else [1, 0]))
            out.scores.append([0.0] * num_slots if following else (scores[row] if row is not None else [-1.0, -2.0]))
        return out

    tensors = []
    for follows in (False, True):
        inputs = selection_inputs(chunks(follows), states, 10, previous)
        assert (inputs.follow is not None) == follows
        ints = torch.zeros(3, len(inputs.ints[0]), dtype=torch.long, device=DEVICE)
        floats = torch.zeros(3, inputs.width, device=DEVICE)
        inputs.to_device(ints, floats, previous)
        tensors.append((ints, floats))
    assert torch.equal(tensors[0][0], tensors[1][0]) and torch.equal(tensors[0][1], tensors[1][1])
