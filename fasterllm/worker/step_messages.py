"""The two messages of a step between the engine and the worker: plain, picklable data.

The engine sends a SchedulerOutput: requests the worker has not seen, then every scheduled request's
chunk with what changed since the worker last saw it (tokens appended, the tail of its block table),
the ids of requests that ended, and the block copies to make first. The worker keeps its own state
per request (tokens, random streams, block tables) from the first message naming it until one lists
it as finished, and returns a ModelRunnerOutput. This module imports nothing else from the package,
so a worker in another process needs only it and the SamplingParams it carries.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

    from fasterllm.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    request_id: str
    token_ids: list[int]  # the prompt and any tokens generated before the worker saw it (a fork's)
    num_prompt_tokens: int
    sampling_params: SamplingParams
    # random streams: with a seed, one for this request and one for each id in sample_ids, the parallel
    # samples its extra rows draw for and that it forks into later (a fork adopts the stream of its id)
    seed: int | None
    sample_ids: list[str]
    bad_word_ids: list[list[int]]  # bad words as token sequences
    early_banned_ids: list[int]  # ids banned while fewer than min_tokens were generated (eos, stop ids)
    # encoder-decoder models: the encoder's input, run (and its cross K/V stored) when a chunk starts at token 0
    encoder_token_ids: list[int] | None = None


@dataclass
class NewSearchData:
    """A beam search the worker has not run yet: beam_width slots, each a row of its own block table."""
    search_id: str
    width: int
    num_candidates: int  # candidates ranked per step over width x vocabulary
    eos_token_ids: list[int]  # a candidate ending in one becomes a hypothesis, not a live beam
    encoder_token_ids: list[int] | None = None


@dataclass
class SearchChunks:
    """The beam searches of a step, one entry each in parallel lists: every computing slot of search i computes
    tokens [starts[i], starts[i] + num_new_tokens[i]) (all slots of a search have the same length). num_slots[i]:
    1 while slot 0 computes the prompt alone, else the width; token_ids[i]: the chunk's input tokens, slot after
    slot. A search with selects[i] picks its next tokens after the chunk, from scores[i] (each slot's cumulative
    logprob; -inf: no beam) with its slots ranked order[i] (best first: ties go to the better beam). A search with
    follows[i] (a lookahead step's decode, scheduled before the step in flight selected) takes its inputs, its slots'
    tables' order, scores and ranking from that selection on the device (worker/beam_follow.py): its token_ids,
    scores and order here are placeholders."""
    search_ids: list[str] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    num_slots: list[int] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)
    selects: list[bool] = field(default_factory=list)
    scores: list[list[float]] = field(default_factory=list)
    order: list[list[int]] = field(default_factory=list)
    follows: list[bool] = field(default_factory=list)
    # search id -> [(slot, first changed index, the slot's table from there on)] for tables grown or reordered
    table_changes: dict[str, list[tuple[int, int, list[int]]]] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return sum(n * slots for n, slots in zip(self.num_new_tokens, self.num_slots))


@dataclass
class SchedulerOutput:
    new_requests: list[NewRequestData] = field(default_factory=list)
    new_searches: list[NewSearchData] = field(default_factory=list)
    searches: SearchChunks = field(default_factory=SearchChunks)
    # the scheduled chunks, one entry per request in parallel lists (no object per request per step: this is
    # the host work of every step). Request i computes tokens [starts[i], starts[i] + num_new_tokens[i]); the
    # last one may be the token the previous step sampled for it, not yet read by the engine (asynchronous
    # scheduling): the worker takes it from that step's samples. num_samples[i]: rows sampled after the
    # chunk (0: a prompt chunk short of the end, 1, or best_of); new_token_ids[i]: its tokens appended since
    # the worker last saw it.
    request_ids: list[str] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    num_samples: list[int] = field(default_factory=list)
    new_token_ids: list[list[int]] = field(default_factory=list)
    # request id -> (first changed index, its block table from there on), for tables grown, copied on write or new
    table_changes: dict[str, tuple[int, list[int]]] = field(default_factory=dict)
    # encoder-decoder models: request (or search) id -> its whole cross-attention block table, when (re)allocated
    cross_tables: dict[str, list[int]] = field(default_factory=dict)
    finished_ids: list[str] = field(default_factory=list)  # dropped before anything else is read
    # block copies made before the forward pass: (device block, CPU block) / (CPU, device) / (device, device)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write
    # structured output: the sampled rows that carry a grammar, and per such row a bitmask of the tokens allowed
    # next ([rows, ceil(vocab / 32)] int32, bit t of word t // 32)
    grammar_rows: list[int] = field(default_factory=list)
    grammar_bitmask: np.ndarray | None = None
    # a lookahead step whose constrained rows' masks depend on tokens the engine has not read yet: the worker runs
    # the forward pass now and samples when GrammarMasks come (the masks are filled meanwhile, overlapping the GPU)
    masks_follow: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens) + self.searches.num_tokens

    @property
    def runs_anything(self) -> bool:
        """Whether the step computes anything (a message may only drop finished requests or move blocks)."""
        return bool(self.request_ids or self.searches.search_ids)

    @property
    def sampled_request_ids(self) -> list[str]:
        """The request of each row the step samples, in row order (a best_of request's rows repeat it)."""
        return [request_id for request_id, count in zip(self.request_ids, self.num_samples) for _ in range(count)]


@dataclass
class GrammarMasks:
    """The masks of a step sent with masks_follow: its rows that carry a grammar and their packed bitmask (as in
    SchedulerOutput)."""
    rows: list[int]
    bitmask: np.ndarray | None


@dataclass
class SearchSelection:
    """The step's selection for each search that selected, in the message's order, as nested lists (search, then
    column: W columns, W the widest search's width; a narrower search's columns past its width are padding).

    The top W candidates over slots x vocabulary by cumulative logprob, best first: candidate_slots (the slot
    continued), candidate_tokens, candidate_scores, candidate_eos (1: the token is one of the search's eos ids:
    among a search's first width candidates such ones become hypotheses). The live continuations (the best width
    that do not end in eos) take the slots: slot_parents[i][j] is the slot that slot j continues (a parent's best
    continuation stays in its slot), slot_tokens / slot_scores its token and cumulative logprob, order[i] the slots
    best first."""
    search_ids: list[str]
    candidate_slots: list[list[int]]
    candidate_tokens: list[list[int]]
    candidate_scores: list[list[float]]
    candidate_eos: list[list[int]]
    slot_parents: list[list[int]]
    slot_tokens: list[list[int]]
    slot_scores: list[list[float]]
    order: list[list[int]]


@dataclass
class ModelRunnerOutput:
    request_ids: list[str]  # the request of each sampled row, in row order (best_of rows repeat it)
    sampled_token_ids: list[int]
    # when a row asked for logprobs: per row the ids (the sampled one first, then the top ones), their
    # logprobs, and the sampled token's rank
    logprob_token_ids: list[list[int]] | None = None
    logprobs: list[list[float]] | None = None
    sampled_ranks: list[int] | None = None
    # request id -> (first prompt position, [ids per position: actual next token first, then the top-n],
    #                [their logprobs], [rank of the actual token])
    prompt_logprobs: dict[str, tuple[int, list[list[int]], list[list[float]], list[int]]] = field(default_factory=dict)
    selection: SearchSelection | None = None  # the beam searches' selection, when any search selected
