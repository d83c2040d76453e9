"""Continuous batching under a token budget (vLLM v1's model).

Every step each scheduled request contributes some new tokens: a whole prompt, a chunk of one, or
the one token it sampled last step. Running requests go first (oldest first), then swapped-out
ones come back, then waiting ones are admitted while the token budget, max_num_seqs and the block
pool allow (new admissions keep a watermark of blocks free for the running ones). A new request
starts from its longest cached prefix. When blocks run out, the latest-admitted running request is
preempted: by recompute (blocks freed, back to the front of the queue, generated tokens kept) or by
swap (its KV copied to the CPU pool, copied back when blocks free up).

A beam search is one request of beam_width slots of the same length (engine/beam_search.py): slot 0 computes
the prompt alone, then every slot computes the same positions, so the search is scheduled, given blocks and
preempted (by recompute) as one unit, and costs the budget its slots' tokens.

schedule() returns the step twice: as the engine reads it back (its Request objects) and as the plain
message the worker runs (worker/step_messages.py): requests it has not seen, each chunk with the tokens and
block-table tail that changed since it last saw the request, the requests that ended, the block copies.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from fasterllm.config import SchedulerConfig
from fasterllm.engine.kv_cache_manager import KVCacheManager, SwapSpace
from fasterllm.engine.request import Request, RequestStatus
from fasterllm.worker.step_messages import SchedulerOutput


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    # a lookahead step (asynchronous scheduling) is scheduled before the step in flight has appended its
    # token: its one new token is that step's sample, at position num_tokens
    lookahead: bool = False
    # position of the first new token: num_computed_tokens unless given (a prompt chunk scheduled while the step
    # computing the chunk before it is in flight starts after that chunk)
    start: int | None = None
    num_slots: int = 1  # a beam search's computing slots, each computing num_new_tokens
    samples: bool = field(init=False)  # this chunk reaches the last known token: the step yields a new one

    def __post_init__(self) -> None:
        if self.lookahead:
            self.start, self.samples = self.request.num_tokens, True
        else:
            if self.start is None:
                self.start = self.request.num_computed_tokens
            self.samples = self.start + self.num_new_tokens == self.request.num_tokens


@dataclass
class ScheduledBatch:
    """One step: what the engine accounts afterwards, and the message the worker runs."""
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    message: SchedulerOutput = field(default_factory=SchedulerOutput)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens * s.num_slots for s in self.scheduled)


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    num_swapped_out: int = 0
    num_swapped_in: int = 0


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager, swap_space: SwapSpace | None = None):
        self.config = config
        self.kv_cache = kv_cache
        self.swap_space = swap_space
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        self.stats = SchedulerStats()
        self.watermark_blocks = max(1, int(config.watermark * kv_cache.num_blocks)) if config.watermark else 0
        self.finished_ids: list[str] = []  # ended since the last message: the worker drops their state

    def add_request(self, request: Request) -> None:
        kv = self.kv_cache
        needed = kv.blocks_for_tokens(len(request.prompt_token_ids) + request.max_tokens)
        # parallel samples and a search's slots share the prompt; each extra one needs its own tail
        width = request.group.width if request.group else request.sampling_params.best_of
        needed += (width - 1) * (kv.blocks_for_tokens(request.max_tokens) + 1)
        encoder_len = len(request.encoder_token_ids or ())
        needed += kv.blocks_for_tokens(encoder_len)  # its cross blocks, shared by its samples and beams
        if encoder_len >= self.config.max_num_batched_tokens:
            raise ValueError(
                f"request {request.request_id!r} has {encoder_len} encoder tokens, but a step computes at most "
                f"max_num_batched_tokens={self.config.max_num_batched_tokens} tokens and its encoder runs in one step "
                "beside its decoder's first token; shorten the input or raise max_num_batched_tokens")
        if width > self.config.max_num_seqs:
            name = "beam_width" if request.group else "best_of"
            raise ValueError(f"{name}={width} is more than max_num_seqs={self.config.max_num_seqs}, and a request's "
                             f"sequences run together; lower {name} (or n) or raise max_num_seqs")
        if request.group and width > self.config.max_num_batched_tokens:
            raise ValueError(f"beam_width={width} is more than max_num_batched_tokens="
                             f"{self.config.max_num_batched_tokens}, and a search's beams decode in one step; lower "
                             "beam_width or raise max_num_batched_tokens")
        cap = self.config.max_prefill_tokens_beside_decodes
        if request.group and cap and width > cap:
            raise ValueError(f"beam_width={width} is more than max_prefill_tokens_beside_decodes={cap}, and a search "
                             "recomputing after a preemption computes its beams' positions together beside decodes; "
                             "lower beam_width or raise max_prefill_tokens_beside_decodes")
        if needed > kv.num_blocks:
            raise ValueError(
                f"request {request.request_id!r} needs up to {needed} KV blocks ({len(request.prompt_token_ids)} "
                f"prompt + {request.max_tokens} new tokens, {width} sequences) but the pool has {kv.num_blocks}; "
                "it could never run. Lower max_tokens (or n, best_of, beam_width) or give the KV cache more memory")
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def schedule(self) -> ScheduledBatch:
        out = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        prompt_budget = self._prompt_budget(any(_decodes(r) for r in (*self.running, *self.swapped)))
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            prompt = not _decodes(request)
            num_new, num_slots = self._next_chunk(request, min(budget, prompt_budget) if prompt else budget)
            if num_new > 0:  # 0: a search whose slots do not all fit the budget left, or no prompt budget left
                if not self._allocate_or_preempt(request, num_new, num_slots, out, index):
                    break  # it was preempted itself: nothing after it runs either
                out.scheduled.append(ScheduledRequest(request, num_new, num_slots=num_slots))
                budget -= num_new * num_slots
                if prompt:
                    prompt_budget -= num_new * num_slots
            index += 1
        if not out.preempted:  # admitting work in a step that had to preempt would only thrash
            budget, prompt_budget = self._swap_in(out, budget, prompt_budget)
            if not self.swapped:  # swapped-out requests come back before new ones start
                self._admit_waiting(out, budget, prompt_budget)
        return self._with_message(out)

    def _prompt_budget(self, with_decodes: bool) -> int:
        """The tokens a step may give prompt chunks (new requests, chunked prompts, recomputation): every decode in
        the step waits for them, so beside decodes max_prefill_tokens_beside_decodes bounds them where set."""
        cap = self.config.max_prefill_tokens_beside_decodes
        return cap if cap and with_decodes else self.config.max_num_batched_tokens

    def _with_message(self, out: ScheduledBatch) -> ScheduledBatch:
        """Fill in the worker's message: it learns a request when first scheduled, then only what changed."""
        message = out.message
        message.copies = self.kv_cache.take_pending_copies()
        message.finished_ids, self.finished_ids = self.finished_ids, []
        ids, starts, num_new, num_samples, new_token_ids = (message.request_ids, message.starts, message.num_new_tokens,
                                                            message.num_samples, message.new_token_ids)
        searches = message.searches
        for item in out.scheduled:  # the hot loop of a large batch's host work: kept lean
            request = item.request
            if request.group is not None:
                self._add_search_chunk(item, message)
                continue
            sent = request.num_sent_tokens
            if sent is None:
                message.new_requests.append(request.new_request_data())
                new_token_ids.append([])
            else:
                new_token_ids.append(request.all_token_ids[sent:])
            request.num_sent_tokens = len(request.all_token_ids)
            ids.append(request.request_id)
            starts.append(item.start)
            num_new.append(item.num_new_tokens)
            num_samples.append(request.samples_to_draw if item.samples else 0)
        scheduled_ids = set(ids).union(searches.search_ids)
        message.table_changes = self.kv_cache.take_table_changes(scheduled_ids)
        if self.kv_cache.cross_changed:
            message.cross_tables = self.kv_cache.take_cross_tables(scheduled_ids)
        return out

    @staticmethod
    def _add_search_chunk(item: ScheduledRequest, message: SchedulerOutput) -> None:
        request, search, chunks = item.request, item.request.group, message.searches
        if request.num_sent_tokens is None:
            message.new_searches.append(search.new_search_data())
            request.num_sent_tokens = 0  # the worker keeps no tokens of a search: each chunk brings its inputs
        chunks.search_ids.append(request.request_id)
        chunks.starts.append(item.start)
        chunks.num_new_tokens.append(item.num_new_tokens)
        chunks.num_slots.append(item.num_slots)
        chunks.token_ids.append([0] * item.num_slots if item.lookahead else  # the selection in flight's, on the device
                                search.chunk_inputs(item.start, item.num_new_tokens, item.num_slots))
        chunks.follows.append(item.lookahead)
        chunks.selects.append(item.samples)
        chunks.scores.append(search.scores)
        chunks.order.append(search.order)
        changes = search.blocks.take_changes()
        if changes:
            chunks.table_changes[request.request_id] = changes

    def _next_chunk(self, request: Request, budget: int) -> tuple[int, int]:
        """(new tokens per sequence, sequences): a request's next chunk, or a search's. A search's slot 0
        computes the prompt alone (again after a preemption), then all its slots compute the same positions."""
        search = request.group
        if search is None:
            return self._chunk(request, budget), 1
        num_prompt = len(request.prompt_token_ids)
        if request.num_computed_tokens < num_prompt:
            return min(self._chunk(request, budget), num_prompt - request.num_computed_tokens), 1
        return self._chunk(request, budget // search.width), search.width

    def _allocate(self, request: Request, num_new: int, num_slots: int, reserve: int = 0) -> bool:
        if request.group is None:
            return self.kv_cache.allocate_slots(request, num_new, reserve)
        selects = request.num_computed_tokens + num_new == request.num_tokens
        return request.group.blocks.allocate(request.num_computed_tokens, num_new, num_slots, selects, reserve)

    def _free(self, request: Request) -> None:
        """Give back a request's blocks (and cross blocks), or a search's."""
        if request.group is not None:
            request.group.blocks.free()
        self.kv_cache.free(request)

    def _chunk(self, request: Request, budget: int, start: int | None = None) -> int:
        """The request's next chunk from `start` (default: its computed tokens), within the budget and the cap."""
        num_new = min(request.num_tokens - (request.num_computed_tokens if start is None else start), budget)
        threshold = self.config.long_prefill_token_threshold
        return min(num_new, threshold) if threshold else num_new

    def _swap_in(self, out: ScheduledBatch, budget: int, prompt_budget: int) -> tuple[int, int]:
        """Bring swapped-out requests back, oldest first, within the budgets; returns what is left of them."""
        num_sequences = _num_sequences(self.running)
        while self.swapped and budget > 0 and num_sequences < self.config.max_num_seqs:
            request = self.swapped[0]
            prompt = not _decodes(request)
            num_new = self._chunk(request, min(budget, prompt_budget) if prompt else budget)
            if num_new <= 0 or not self.kv_cache.allocate_slots(request, num_new, reserve=self.watermark_blocks):
                break
            self.swapped.popleft()
            cpu_blocks = self.swap_space.release(request.request_id)
            out.message.swap_in.extend(zip(cpu_blocks, self.kv_cache.block_table(request.request_id)))
            self.stats.num_swapped_in += 1
            num_sequences += _num_sequences([request])
            self._start(request, num_new, out)
            budget -= num_new
            if prompt:
                prompt_budget -= num_new
        return budget, prompt_budget

    def _admit_waiting(self, out: ScheduledBatch, budget: int, prompt_budget: int) -> None:
        """Admit from the front of the queue within the step's budget and its prompt budget. max_num_seqs counts the
        sequences a request forks into after its first step (n / best_of) or a search's width, so a step never holds
        more than that many."""
        num_sequences = _num_sequences(self.running)
        while budget > 0 and prompt_budget > 0:
            # a request whose grammar is still being compiled keeps its place; those behind it go on
            position = next((i for i, r in enumerate(self.waiting) if r.grammar_pending is None), None)
            if position is None:
                return
            request = self.waiting[position]
            wanted = _num_sequences([request])
            if num_sequences + wanted > self.config.max_num_seqs:
                return
            searching = request.group is not None
            hit_tokens = 0 if searching else self.kv_cache.match_prefix(request)  # a search's blocks are its own
            request.num_computed_tokens = hit_tokens
            # its encoder runs beside its first chunk, whole: the step's budget must hold it, the prompt budget only
            # bounds the chunk (an encoder longer than the prompt budget would otherwise never start)
            encoder_len = len(request.encoder_token_ids or ())
            num_new, num_slots = self._next_chunk(request, min(budget - encoder_len, prompt_budget))
            if num_new <= 0 or not self.kv_cache.allocate_cross(request, reserve=self.watermark_blocks) or \
                    not self._allocate(request, num_new, num_slots, reserve=self.watermark_blocks):
                self._free(request) if searching else self.kv_cache.undo_match(request, hit_tokens)
                request.num_computed_tokens = 0
                return
            num_sequences += wanted
            budget -= num_new * num_slots + encoder_len
            prompt_budget -= num_new * num_slots + encoder_len
            del self.waiting[position]
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = time.time()
            self._start(request, num_new, out, num_slots)

    def _start(self, request: Request, num_new: int, out: ScheduledBatch, num_slots: int = 1) -> None:
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        out.scheduled.append(ScheduledRequest(request, num_new, num_slots=num_slots))

    def _allocate_or_preempt(self, request: Request, num_new: int, num_slots: int, out: ScheduledBatch,
                             index: int) -> bool:
        """Allocate, preempting the latest-admitted requests while short; False if running[index] itself went."""
        while not self._allocate(request, num_new, num_slots):
            self._preempt(self.running.pop(), out)
            if len(self.running) == index:
                return False
        return True

    def _preempt(self, request: Request, out: ScheduledBatch) -> None:
        out.preempted.append(request)
        self.stats.num_preemptions += 1
        request.num_preemptions += 1
        table = self.kv_cache.block_table(request.request_id)
        if (self.config.preemption_mode == "swap" and self.swap_space is not None
                and request.group is None  # a search computes its slots again from the prompt
                and request.encoder_token_ids is None  # its encoder runs again instead (cross blocks are not swapped)
                and self.swap_space.can_hold(len(table))):
            out.message.swap_out.extend(zip(table, self.swap_space.take(request.request_id, len(table))))
            self.kv_cache.free(request)
            request.status = RequestStatus.SWAPPED
            self.stats.num_swapped_out += 1
            self.swapped.appendleft(request)
            return
        # recompute (also the fallback when the CPU pool is full): its cached full blocks may still hit
        self._free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def update(self, out: ScheduledBatch, sampled: dict[str, int]) -> None:
        """Account the computed tokens and append the sampled ones (whether they stop is check_stop's to say)."""
        now = time.time()
        for item in out.scheduled:
            request = item.request
            if request.finished:  # ended (a stop, an abort) after a lookahead step had been launched for it
                continue
            request.num_computed_tokens += item.num_new_tokens
            self.kv_cache.cache_full_blocks(request)
            token = sampled.get(request.request_id)
            if token is None:
                continue
            request.append_token(token)
            request.metrics.first_token_time = request.metrics.first_token_time or now
            request.metrics.last_token_time = now

    def add_forked(self, child: Request, first_token: int) -> None:
        """A parallel sample forked from its parent after the prompt: running, with its first token."""
        child.status = RequestStatus.RUNNING
        self.running.append(child)
        child.append_token(first_token)
        child.metrics.first_token_time = child.metrics.last_token_time = time.time()

    def finish_request(self, request: Request, reason: str, stop_reason: int | str | None = None) -> None:
        """End a request (a stop, an abort, an error): it leaves its queue and frees its blocks."""
        if request.finished:
            return
        # only its own queue is searched (a beam search ends hundreds of beams a step out of the running list)
        queue = {RequestStatus.WAITING: self.waiting, RequestStatus.SWAPPED: self.swapped,
                 RequestStatus.RUNNING: self.running}[request.status]
        request.finish(reason, stop_reason)
        if request in queue:
            queue.remove(request)
        if self.swap_space is not None:
            self.swap_space.release(request.request_id)
        self._free(request)
        self.finished_ids.extend(request.worker_ids)


class AsyncScheduler(Scheduler):
    """Asynchronous scheduling: the next decode step can be scheduled while the step before it still runs."""

    def schedule_lookahead(self, in_flight: ScheduledBatch, sampled_ids: list[str]) -> ScheduledBatch | None:
        """The next step, scheduled while the step in flight still runs: each request that step samples decodes the
        token it samples (sampled_ids: the request of each sampled row; the worker takes the token from that step's
        samples; a request at its token limit after that token is left out, it finishes), a prompt that step computes
        a chunk of goes on with its next chunk, other running requests with theirs, then waiting requests are
        admitted with the budget left. Only where nothing needs the in-flight tokens on the host first (each sampling
        request samples one row, none has logit controls: those read the tokens, and every running beam search
        decodes in the step in flight and goes on after its selection: its next inputs follow that selection on the
        device; a grammar's mask is filled after the in-flight tokens are read, while this step's forward pass runs),
        nothing is swapped out, and every chunk gets its blocks without preempting; otherwise None, and the next
        step is scheduled once the tokens are read."""
        flying = set(sampled_ids)
        if len(flying) != len(sampled_ids) or self.swapped or any(
                item.request.sampling_params.controls_logits for item in in_flight.scheduled if item.samples):
            return None
        decoding_searches = {id(item.request) for item in in_flight.scheduled
                             if item.request.group is not None and _follows(item)}
        if any(r.group is not None and id(r) not in decoding_searches for r in self.running):
            return None
        in_flight_chunks = {id(item.request): item.num_new_tokens for item in in_flight.scheduled if not item.samples}
        out = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        decoding = [r for r in self.running if r.request_id in flying and len(r.output_token_ids) + 1 < r.max_tokens]
        others = [r for r in self.running if r.request_id not in flying]
        prompt_budget = self._prompt_budget(bool(decoding) or any(_decodes(r) for r in others))
        # decodes first (they are the latency), then chunks, as schedule() orders its budget
        for request in decoding + others:
            if request.group is not None:  # each slot decodes the token the selection in flight gives it
                item = ScheduledRequest(request, 1, lookahead=True, num_slots=request.group.width)
                if budget < item.num_slots or not request.group.blocks.allocate(item.start, 1, item.num_slots, True):
                    return None
                out.scheduled.append(item)
                budget -= item.num_slots
                continue
            if request.request_id in flying:
                item = ScheduledRequest(request, 1, lookahead=True)
                ahead = request.num_tokens - request.num_computed_tokens + 1  # the in-flight token, then this one
            else:
                prompt = not _decodes(request)  # a chunk in flight is not computed yet: what follows it is prompt
                start = request.num_computed_tokens + in_flight_chunks.get(id(request), 0)
                num_new = self._chunk(request, min(budget, prompt_budget) if prompt else budget, start)
                if num_new <= 0:
                    continue
                item = ScheduledRequest(request, num_new, start=start)
                ahead = start - request.num_computed_tokens + num_new
                if prompt:
                    prompt_budget -= num_new
            if budget < item.num_new_tokens or not self.kv_cache.allocate_slots(request, ahead):
                return None  # what was taken stays in the tables: the next step needs it anyway
            out.scheduled.append(item)
            budget -= item.num_new_tokens
        self._admit_waiting(out, budget, prompt_budget)
        return self._with_message(out) if out.scheduled else None


def _follows(item: ScheduledRequest) -> bool:
    """Whether a beam search's next step can be scheduled before its in-flight chunk's selection is read: the chunk
    decodes every slot and selects, and that selection is not its last (the token limit)."""
    search = item.request.group
    return item.samples and item.num_slots == search.width and search.num_steps + 1 < search.max_new_tokens


def _decodes(request: Request) -> bool:
    """Whether a running request's next chunk is its last token alone (a search's slots: one position each)."""
    return request.num_computed_tokens >= request.num_tokens - 1


def _num_sequences(requests: list[Request]) -> int:
    """The sequences these requests run as, or will once their first step forks them: a search its width, a
    request that has yet to draw its first token its best_of, any other request one."""
    return sum(r.samples_to_draw if r.group is None else r.group.width for r in requests)
