"""Beam search over the engine's requests: one Request per live beam, forked copy-on-write.

FasterTransformer's decoding keeps beam_width rows per sentence and reorders their caches after
each step; here a beam that is chosen more than once forks its block table instead (blocks are
shared, a block written by one beam is copied first), and a beam that is not chosen frees its
blocks. Each step follows transformers' beam search: the top (1 + #eos, at least 2) x beam_width
continuations over all beams x vocabulary by cumulative logprob; those ending (eos, or the token
limit) among the first beam_width become hypotheses scored cumulative_logprob / length **
length_penalty; the best beam_width that do not end stay live.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fasterllm.engine.request import Request
from fasterllm.loader.tokenizer import TokenizerWrapper
from fasterllm.outputs import CompletionOutput, RequestOutput
from fasterllm.sampling_params import BeamSearchParams

if TYPE_CHECKING:
    from fasterllm.engine.scheduler import Scheduler
    from fasterllm.engine.sequence_forks import SequenceForks
    from fasterllm.worker.step_messages import ModelRunnerOutput


@dataclass
class Hypothesis:
    token_ids: list[int]
    cumulative_logprob: float
    score: float  # cumulative_logprob / len(token_ids) ** length_penalty
    finish_reason: str  # "stop" (ended with eos) or "length"


@dataclass
class Continuation:
    parent: Request
    token_id: int
    cumulative_logprob: float


class BeamSearch:
    """The state of one prompt's search: its live beams, their reported candidates, its hypotheses. A
    request.SequenceGroup: what the scheduler and the worker see of it."""

    def __init__(self, params: BeamSearchParams, eos_token_ids: list[int]):
        self.params = params
        self.width = params.beam_width
        self.eos_token_ids = frozenset(() if params.ignore_eos else eos_token_ids)
        self.num_candidates = self.num_top_logprobs = max(2, 1 + len(self.eos_token_ids)) * params.beam_width
        self.max_new_tokens = params.max_tokens
        self.head: Request | None = None  # the request the search was asked as; its id names the output
        self.beams: list[Request] = []  # live, best first
        self.pruned: list[Request] = []  # beams the last step did not continue: their blocks are freed
        self._beam_ids = itertools.count(1)
        self.reported: dict[str, tuple[list[int], list[float]]] = {}  # beam id -> its top candidates
        self.hypotheses: list[Hypothesis] = []  # best first, at most beam_width
        self.done = False

    def start(self, head: Request) -> None:
        """The prompt's request is the first beam; the context's room may lower the token limit."""
        head.group = self
        self.head, self.beams = head, [head]
        self.max_new_tokens = head.max_tokens

    @property
    def members(self) -> list[Request]:
        return self.beams

    def next_beam_id(self) -> str:
        return f"{self.head.request_id}#beam{next(self._beam_ids)}"

    def report(self, beam: Request, token_ids: list[int], logprobs: list[float]) -> bool:
        """Keep a beam's top candidates for the next token; True once every live beam has reported.

        A beam that reported waits (schedules nothing) until the rest of its search has."""
        self.reported[beam.request_id] = (token_ids[:self.num_candidates], logprobs[:self.num_candidates])
        return len(self.reported) == len(self.beams)  # a live beam reports once a step

    def forget(self, beam: Request) -> None:
        """A preempted beam recomputes its KV and reports again."""
        self.reported.pop(beam.request_id, None)

    def select(self) -> list[Continuation]:
        """One step over every live beam's candidates: returns the continuations that stay live, best
        first, and records the hypotheses that end here."""
        candidates = [(beam.cumulative_logprob + logprob, beam, token_id)
                      for beam in self.beams
                      for token_id, logprob in zip(*self.reported[beam.request_id])]
        self.reported.clear()
        candidates.sort(key=lambda c: c[0], reverse=True)  # stable: ties keep beam order, then rank
        width, penalty = self.params.beam_width, self.params.length_penalty
        new_length = len(self.beams[0].output_token_ids) + 1
        at_limit = new_length >= self.max_new_tokens
        live: list[Continuation] = []
        for rank, (cumulative, beam, token_id) in enumerate(candidates[:self.num_candidates]):
            if not at_limit and token_id not in self.eos_token_ids:
                if len(live) < width:
                    live.append(Continuation(beam, token_id, cumulative))
            elif rank < width:  # only the top beam_width candidates may end the search's hypotheses
                self.hypotheses.append(Hypothesis(beam.output_token_ids + [token_id], cumulative,
                                                  cumulative / new_length ** penalty,
                                                  "length" if token_id not in self.eos_token_ids else "stop"))
        self.hypotheses = sorted(self.hypotheses, key=lambda h: h.score, reverse=True)[:width]
        full = len(self.hypotheses) == width
        improvable = True
        if live and full:  # can the best live beam still beat the worst hypothesis?
            length = self.max_new_tokens if self.params.early_stopping == "never" and penalty > 0 else new_length
            improvable = live[0].cumulative_logprob / length ** penalty > self.hypotheses[-1].score
        self.done = not live or not improvable or (self.params.early_stopping is True and full)
        return live

    def make_output(self, tokenizer: TokenizerWrapper) -> RequestOutput:
        """The n best hypotheses, best first, as the finished output of the search's first request."""
        head = self.head
        completions = [CompletionOutput(
            index=index, text=tokenizer.decode(h.token_ids, self.params.skip_special_tokens),
            token_ids=h.token_ids, cumulative_logprob=h.cumulative_logprob, logprobs=None,
            finish_reason=h.finish_reason, score=h.score)
            for index, h in enumerate(self.hypotheses[:self.params.n])]
        return RequestOutput(head.request_id, head.prompt, head.prompt_token_ids, completions, True, head.metrics,
                             encoder_prompt=head.encoder_prompt, encoder_prompt_token_ids=head.encoder_token_ids)


# ---- a step's beam work, in the order the engine's step runs it ----------------------------------------
def report_beams(beam_rows: list[tuple[int, Request]], result: ModelRunnerOutput) -> list[BeamSearch]:
    """Give each beam its row's top candidates; returns the searches whose every beam has reported."""
    ready: dict[int, BeamSearch] = {}
    for row, beam in beam_rows:  # column 0 is the sampled token, the top candidates follow
        if beam.group.report(beam, result.logprob_token_ids[row][1:], result.logprobs[row][1:]):
            ready[id(beam.group)] = beam.group
    return list(ready.values())


def continue_beams(search: BeamSearch, first_tokens: dict[str, int], computed: dict[str, int],
                   forks: SequenceForks) -> list[tuple[Request, int]]:
    """Make the search's chosen continuations its beams: a beam chosen once continues itself (its token goes in
    first_tokens), each further choice forks it; beams not chosen are left in search.pruned. Returns the tokens of
    beams that were waiting for their search (not scheduled this step), appended after the bookkeeping."""
    continued: set[str] = set()
    beams, waited = [], []
    for choice in search.select():
        parent = choice.parent
        if parent.request_id in continued:
            beam = forks.fork(parent, search.next_beam_id(), choice.token_id,
                              computed.get(parent.request_id, parent.num_computed_tokens))
        else:
            continued.add(parent.request_id)
            beam = parent
            if parent.request_id in computed:
                first_tokens[parent.request_id] = choice.token_id
            else:
                waited.append((parent, choice.token_id))
        beam.cumulative_logprob = choice.cumulative_logprob
        beams.append(beam)
    search.pruned = [beam for beam in search.beams if beam.request_id not in continued]
    search.beams = beams
    return waited


def end_beams(searches: list[BeamSearch], scheduler: Scheduler, requests: dict[str, Request],
              tokenizer: TokenizerWrapper) -> list[RequestOutput]:
    """Free the beams that were not chosen; a search that is done gives its output and leaves requests."""
    outputs = []
    for search in searches:
        for beam in search.pruned + (search.beams if search.done else []):
            scheduler.finish_request(beam, "stop")
            if beam is not search.head:
                del requests[beam.request_id]
        if search.done:
            search.head.metrics.finished_time = time.time()
            outputs.append(search.make_output(tokenizer))
            del requests[search.head.request_id]
    return outputs
