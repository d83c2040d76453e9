"""The worker's own copy of each request it runs, kept up to date from the step messages alone.

A request's state (tokens, block table, what its logits controls need) lives from the message that first
schedules it until one lists it as finished. A seeded request's random streams live here too, one per sample id:
its own, and one for each parallel sample it draws the first token of and later forks into (the fork, sent
as a new request under that id, goes on drawing from the same stream).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fasterllm.sampling_params import SamplingParams
from fasterllm.worker.beam_search import SearchState
from fasterllm.worker.step_messages import NewRequestData, SchedulerOutput

SAMPLE_SEED_STRIDE = 1_000_003  # sample i of a seeded request draws from seed + i * stride


@dataclass
class RequestState:
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    sample_ids: list[str]
    bad_word_ids: list[list[int]]
    early_banned_ids: list[int]
    block_table: list[int]
    encoder_token_ids: list[int] | None = None
    cross_block_table: list[int] | None = None  # where the encoder's K/V of every decoder layer lie

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


class RequestStates:
    def __init__(self, device: torch.device):
        self.device = device
        self.states: dict[str, RequestState] = {}
        self.generators: dict[str, torch.Generator] = {}  # sample id -> its random stream
        self.searches: dict[str, SearchState] = {}  # beam searches: their slots' block tables

    def update(self, message: SchedulerOutput) -> None:
        """Finished requests go first (an id may come back as a new request in the same message), then new
        ones, then the scheduled requests' appended tokens and changed block-table tails."""
        for request_id in message.finished_ids:
            self.states.pop(request_id, None)
            self.generators.pop(request_id, None)
            self.searches.pop(request_id, None)
        for new in message.new_requests:
            self._add(new)
        for new_search in message.new_searches:
            self.searches[new_search.search_id] = SearchState.new(new_search)
        states = self.states
        for request_id, new_token_ids in zip(message.request_ids, message.new_token_ids):
            if new_token_ids:
                states[request_id].token_ids.extend(new_token_ids)
        for request_id, (start, tail) in message.table_changes.items():
            table = states[request_id].block_table
            del table[start:]
            table.extend(tail)
        for search_id, changes in message.searches.table_changes.items():
            self.searches[search_id].apply(changes)
        for request_id, table in message.cross_tables.items():
            (states.get(request_id) or self.searches[request_id]).cross_block_table = table

    def _add(self, new: NewRequestData) -> None:
        self.states[new.request_id] = RequestState(
            list(new.token_ids), new.num_prompt_tokens, new.sampling_params, new.sample_ids, new.bad_word_ids,
            new.early_banned_ids, [], new.encoder_token_ids)
        if new.seed is not None:
            for index, sample_id in enumerate([new.request_id, *new.sample_ids]):
                generator = torch.Generator(device=self.device)
                self.generators[sample_id] = generator.manual_seed(new.seed + SAMPLE_SEED_STRIDE * index)

    def row_generators(self, request_ids: list[str]) -> list[torch.Generator | None]:
        """The stream of each sampled row: a request's own on its first row, its samples' on the rows after."""
        if not self.generators:
            return [None] * len(request_ids)
        generators, seen = [], {}
        for request_id in request_ids:
            index = seen.get(request_id, 0)
            seen[request_id] = index + 1
            sample_id = request_id if index == 0 else self.states[request_id].sample_ids[index - 1]
            generators.append(self.generators.get(sample_id))
        return generators
