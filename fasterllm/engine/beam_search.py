"""Beam search: one request per search, beam_width slots for its whole life, the selection made on the worker.

As FasterTransformer's decoding keeps beam_width rows per sentence, a search keeps beam_width slots, each a row
with its own block table (engine/beam_blocks.py); all beams have the same length, so the scheduler runs a search as
one unit. Each step the worker ranks, for every search of the step at once, the top (1 + #eos, at least 2) x
beam_width continuations over all slots x vocabulary by cumulative logprob, as transformers' beam search does
(worker/beam_search.py). Here, per search and not per beam: those ending (eos, or the token limit) among the first
beam_width become hypotheses scored cumulative_logprob / length ** length_penalty; the best beam_width that do not
end stay live, and the slot tables are reordered by their parents. A beam's tokens are kept as one (parent slot,
token) pair per step and read back (from the last step to the first, as FasterTransformer's finalize does) only
for the hypotheses returned, or for every slot when a preempted search computes its slots again.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from fasterllm.engine.beam_blocks import SearchBlocks
from fasterllm.engine.kv_cache_manager import KVCacheManager
from fasterllm.engine.request import Request
from fasterllm.loader.tokenizer import TokenizerWrapper
from fasterllm.outputs import CompletionOutput, RequestOutput
from fasterllm.sampling_params import BeamSearchParams
from fasterllm.worker.step_messages import NewSearchData, SearchSelection

if TYPE_CHECKING:
    from fasterllm.engine.scheduler import ScheduledBatch, Scheduler


@dataclass
class Hypothesis:
    step: int  # the selection it ended in (tokens generated before its last one)
    parent: int  # the slot whose beam it continued
    token_id: int  # its last token
    cumulative_logprob: float
    score: float  # cumulative_logprob / (step + 1) ** length_penalty
    finish_reason: str  # "stop" (ended with eos) or "length"


class BeamSearch:
    """The state of one prompt's search (a request.SequenceGroup): its slots' blocks and histories, their cumulative
    logprobs, its hypotheses."""

    def __init__(self, params: BeamSearchParams, eos_token_ids: list[int]):
        self.params = params
        self.width = params.beam_width
        self.eos_token_ids = sorted(set(() if params.ignore_eos else eos_token_ids))
        self.num_candidates = max(2, 1 + len(self.eos_token_ids)) * params.beam_width
        self.max_new_tokens = params.max_tokens
        self.head: Request | None = None  # the search's one request: its id names the output
        self.blocks: SearchBlocks | None = None
        # per slot, best first by rank: cumulative logprob (-inf: no beam yet; slot 0 holds the prompt)
        self.scores = [0.0] + [float("-inf")] * (self.width - 1)
        self.order = list(range(self.width))
        self.num_steps = 0  # selections made: the length of every live beam
        # a lookahead step launched before the selection in flight was read: its slots follow that selection on the
        # device (their tables reordered and partly filled blocks copied there)
        self.followed = False
        self.parents = self.tokens = np.zeros((0, self.width), dtype=np.int64)  # per step: per slot
        self._slot_outputs: list[list[int]] | None = None  # every slot's tokens, read back for a recompute
        self.hypotheses: list[Hypothesis] = []  # best first, at most beam_width
        self.done = False

    def start(self, head: Request, kv_cache: KVCacheManager) -> None:
        """The search runs as its prompt's request; the context's room may lower the token limit."""
        head.group = self
        self.head = head
        self.max_new_tokens = head.max_tokens
        self.blocks = SearchBlocks(kv_cache, self.width)
        self.parents = np.zeros((self.max_new_tokens, self.width), dtype=np.int64)
        self.tokens = np.zeros((self.max_new_tokens, self.width), dtype=np.int64)

    def new_search_data(self) -> NewSearchData:
        return NewSearchData(self.head.request_id, self.width, self.num_candidates, self.eos_token_ids,
                             self.head.encoder_token_ids)

    def chunk_inputs(self, start: int, num_new: int, num_slots: int) -> list[int]:
        """The input tokens of a chunk of num_new positions from start, slot after slot."""
        prompt = self.head.prompt_token_ids
        if start < len(prompt):  # slot 0 computes the prompt alone
            return prompt[start:start + num_new]
        first = start - len(prompt)
        if num_new == 1 and first == self.num_steps - 1:  # decoding: each slot's last selected token
            return self.tokens[first].tolist()
        if self._slot_outputs is None:
            history = self._history()
            self._slot_outputs = [self._beam_tokens(history, self.num_steps, slot) for slot in range(self.width)]
        return [token for tokens in self._slot_outputs for token in tokens[first:first + num_new]]

    def advance(self, selection: SearchSelection, index: int) -> None:
        """Take the step's selection (this search's is row `index`): new hypotheses, the live beams in their slots,
        and whether the search is done."""
        width, penalty = self.width, self.params.length_penalty
        metrics, now = self.head.metrics, time.time()
        metrics.first_token_time, metrics.last_token_time = metrics.first_token_time or now, now
        step = self.num_steps
        new_length = step + 1
        at_limit = new_length >= self.max_new_tokens
        eos = selection.candidate_eos[index][:width]
        if at_limit or any(eos):  # only the top beam_width candidates may end as hypotheses
            slots, tokens, scores = (selection.candidate_slots[index], selection.candidate_tokens[index],
                                     selection.candidate_scores[index])
            for rank in range(width):
                if at_limit or eos[rank]:
                    self.hypotheses.append(Hypothesis(step, slots[rank], tokens[rank], scores[rank],
                                                      scores[rank] / new_length ** penalty,
                                                      "stop" if eos[rank] else "length"))
            self.hypotheses = sorted(self.hypotheses, key=lambda h: h.score, reverse=True)[:width]
        full = len(self.hypotheses) == width
        scores = selection.slot_scores[index][:width]
        order = selection.order[index][:width]
        improvable = True
        if not at_limit and full:  # can the best live beam still beat the worst hypothesis?
            length = self.max_new_tokens if self.params.early_stopping == "never" and penalty > 0 else new_length
            improvable = scores[order[0]] / length ** penalty > self.hypotheses[-1].score
        self.done = at_limit or not improvable or (self.params.early_stopping is True and full)
        if self.done:
            return
        parents, tokens = selection.slot_parents[index][:width], selection.slot_tokens[index][:width]
        self.parents[step], self.tokens[step] = parents, tokens
        self.scores, self.order = scores, order
        self.num_steps, self._slot_outputs = new_length, None
        self.blocks.reorder(parents, self.head.num_computed_tokens, copied=self.followed)
        self.followed = False
        # the request's tokens count the search's length (the scheduler's chunks); the best beam's stand for them
        self.head.append_token(tokens[order[0]])

    def _history(self) -> tuple[list[list[int]], list[list[int]]]:
        """Every step's parents and tokens per slot, as lists: read back once per call site, not once per beam."""
        return self.parents[:self.num_steps].tolist(), self.tokens[:self.num_steps].tolist()

    @staticmethod
    def _beam_tokens(history: tuple[list[list[int]], list[list[int]]], num_steps: int, slot: int) -> list[int]:
        """The tokens of the beam in `slot` after num_steps selections, read back through the parents."""
        parents, step_tokens = history
        tokens = []
        for step in range(num_steps - 1, -1, -1):
            tokens.append(step_tokens[step][slot])
            slot = parents[step][slot]
        return tokens[::-1]

    def make_output(self, tokenizer: TokenizerWrapper) -> RequestOutput:
        """The n best hypotheses, best first, as the finished output of the search's request."""
        head = self.head
        completions = []
        history = self._history()  # a hypothesis ended at a step no later than the search's last
        for index, h in enumerate(self.hypotheses[:self.params.n]):
            token_ids = self._beam_tokens(history, h.step, h.parent) + [h.token_id]
            completions.append(CompletionOutput(
                index=index, text=tokenizer.decode(token_ids, self.params.skip_special_tokens), token_ids=token_ids,
                cumulative_logprob=h.cumulative_logprob, logprobs=None, finish_reason=h.finish_reason, score=h.score))
        return RequestOutput(head.request_id, head.prompt, head.prompt_token_ids, completions, True, head.metrics,
                             encoder_prompt=head.encoder_prompt, encoder_prompt_token_ids=head.encoder_token_ids)


def advance_searches(batch: ScheduledBatch, selection: SearchSelection | None, scheduler: Scheduler,
                     requests: dict[str, Request], tokenizer: TokenizerWrapper) -> list[RequestOutput]:
    """Give each search of the step its selection; a search that is done frees its blocks and gives its output."""
    if selection is None:
        return []
    # by object, not id: a search aborted since its step was scheduled may have had its id added again
    live = {item.request.request_id: item.request for item in batch.scheduled
            if item.request.group is not None and not item.request.finished}
    outputs = []
    for index, search_id in enumerate(selection.search_ids):
        head = live.get(search_id)
        if head is None:
            continue
        search = head.group
        search.advance(selection, index)
        if search.done:
            scheduler.finish_request(head, "stop")
            head.metrics.finished_time = time.time()
            outputs.append(search.make_output(tokenizer))
            del requests[search_id]
    return outputs

