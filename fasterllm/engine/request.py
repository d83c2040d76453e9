"""A request's state: its tokens, how many of them have KV in the cache, and where it is in its life."""
from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING, Protocol

from fasterllm.outputs import RequestMetrics, SampleLogprobs
from fasterllm.sampling_params import SamplingParams
from fasterllm.worker.step_messages import NewRequestData, NewSearchData

if TYPE_CHECKING:
    from fasterllm.engine.beam_blocks import SearchBlocks


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted with its KV copied to the CPU pool
    FINISHED = "finished"


class SequenceGroup(Protocol):
    """Sequences that run as one request (the beams of a search, beam_search.BeamSearch): width slots of the same
    length, each with its own block table. What the scheduler sees of it: how many sequences it runs, its blocks,
    and each chunk's input tokens, cumulative logprobs and slot ranking for the worker."""
    width: int
    blocks: SearchBlocks
    scores: list[float]
    order: list[int]

    def new_search_data(self) -> NewSearchData: ...

    def chunk_inputs(self, start: int, num_new: int, num_slots: int) -> list[int]: ...


class Request:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 sampling_params: SamplingParams, eos_token_ids: list[int], max_model_len: int,
                 arrival_time: float | None = None, encoder_prompt: str | None = None,
                 encoder_token_ids: list[int] | None = None):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids  # an encoder-decoder model's: the decoder's prompt
        # an encoder-decoder model's encoder input (run when its decoder computes from token 0); None: decoder-only
        self.encoder_prompt = encoder_prompt
        self.encoder_token_ids = encoder_token_ids
        self.sampling_params = sampling_params
        self.eos_token_ids = () if sampling_params.ignore_eos else tuple(eos_token_ids)
        self.stop_token_ids = tuple(sampling_params.stop_token_ids or ())
        # never past the context: generation ends with "length" there
        room = max_model_len - len(prompt_token_ids)
        self.max_tokens = room if sampling_params.max_tokens is None else min(sampling_params.max_tokens, room)
        self.output_token_ids: list[int] = []
        self.all_token_ids = list(prompt_token_ids)
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.block_hashes: list[int] = []  # prefix-cache hashes of its full blocks, filled as they are needed
        self.bad_word_ids: list[list[int]] = []  # sampling_params.bad_words as token sequences
        # parallel sampling: the parent computes the prompt once, then forks best_of - 1 children that
        # share its blocks copy-on-write; all of them are listed here, the parent first
        self.family: list[Request] = [self]
        # the ids its extra sample rows draw for and it forks into (on the worker: their random streams)
        self.sample_ids: list[str] = []
        self.num_sent_tokens: int | None = None  # tokens the worker has of it; None until it is first scheduled
        self.group: SequenceGroup | None = None  # the beam search it runs, if it is one
        self.matcher = None  # structured output: its grammar matcher (engine/structured_output.py), or None
        self.grammar_pending = None  # the Future of its matcher while a thread builds it: not schedulable until done
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.logprobs: SampleLogprobs | None = [] if sampling_params.logprobs is not None else None
        self.prompt_logprobs: list | None = [None] if sampling_params.prompt_logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.num_preemptions = 0
        self.metrics = RequestMetrics(arrival_time=time.time() if arrival_time is None else arrival_time)

    @property
    def samples_to_draw(self) -> int:
        """Rows this request samples this step: best_of at the parent's first token, else one."""
        return self.sampling_params.best_of if self.family[0] is self and not self.output_token_ids else 1

    def new_request_data(self) -> NewRequestData:
        """What the worker is told when it first runs this request; a fork's seed is None: it draws from
        the stream its parent's row for it started."""
        seed = self.sampling_params.seed if self.family[0] is self else None
        return NewRequestData(self.request_id, list(self.all_token_ids), len(self.prompt_token_ids),
                              self.sampling_params, seed, self.sample_ids, self.bad_word_ids,
                              [*self.eos_token_ids, *self.stop_token_ids], self.encoder_token_ids)

    @property
    def worker_ids(self) -> list[str]:
        """What the worker holds under this request: its own id, and its samples' until they are forked."""
        return [self.request_id, *self.sample_ids] if len(self.family) == 1 else [self.request_id]

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def family_finished(self) -> bool:
        """Whether it and every parallel sample of its family have finished (the family's output is final)."""
        family = self.family
        if len(family) == 1:  # asked of every request every step: most have no parallel samples
            return self.finished
        return all(member.finished for member in family)

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.metrics.finished_time = time.time()
