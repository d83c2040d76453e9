"""Continuous batching under a token budget (vLLM v1's model).

Every step each scheduled request contributes some new tokens: a whole prompt, a chunk of one, or
the one token it sampled last step. Running requests go first (oldest first), then swapped-out
ones come back, then waiting ones are admitted while the token budget, max_num_seqs and the block
pool allow (new admissions keep a watermark of blocks free for the running ones). A new request
starts from its longest cached prefix. When blocks run out, the latest-admitted running request is
preempted: by recompute (blocks freed, back to the front of the queue, generated tokens kept) or by
swap (its KV copied to the CPU pool, copied back when blocks free up).

schedule() returns the step twice: as the engine reads it back (its Request objects) and as the plain
message the worker runs (worker/step_messages.py): requests it has not seen, each chunk with the tokens and
block-table tail that changed since it last saw the request, the requests that ended, the block copies.
"""
from __future__ import annotations

import itertools
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
        return sum(s.num_new_tokens for s in self.scheduled)


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
        # parallel samples and a group's members share the prompt; each extra one needs its own tail
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
        groups = _groups(self.running)
        index = 0
        while index < len(groups) and budget > 0:
            scheduled = []
            for request in groups[index]:
                num_new = self._chunk(request, budget)
                if num_new == 0:  # a member that waits for the rest of its group (a beam search), or no budget
                    continue
                if not self._allocate_or_preempt(request, num_new, out, groups, index):
                    break
                scheduled.append(ScheduledRequest(request, num_new))
                budget -= num_new
            else:
                out.scheduled.extend(scheduled)
                index += 1
                continue
            break  # the group itself was preempted: nothing after it runs either
        if not out.preempted:  # admitting work in a step that had to preempt would only thrash
            budget = self._swap_in(out, budget)
            if not self.swapped:  # swapped-out requests come back before new ones start
                self._admit_waiting(out, budget)
        return self._with_message(out)

    def _with_message(self, out: ScheduledBatch) -> ScheduledBatch:
        """Fill in the worker's message: it learns a request when first scheduled, then only what changed."""
        message = out.message
        message.copies = self.kv_cache.take_pending_copies()
        message.finished_ids, self.finished_ids = self.finished_ids, []
        ids, starts, num_new, num_samples, new_token_ids = (message.request_ids, message.starts, message.num_new_tokens,
                                                            message.num_samples, message.new_token_ids)
        for item in out.scheduled:  # the hot loop of a large batch's host work: kept lean
            request = item.request
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
        scheduled_ids = set(ids)
        message.table_changes = self.kv_cache.take_table_changes(scheduled_ids)
        if self.kv_cache.cross_changed:
            message.cross_tables = self.kv_cache.take_cross_tables(scheduled_ids)
        return out

    def _chunk(self, request: Request, budget: int, start: int | None = None) -> int:
        """The request's next chunk from `start` (default: its computed tokens), within the budget and the cap."""
        num_new = min(request.num_tokens - (request.num_computed_tokens if start is None else start), budget)
        threshold = self.config.long_prefill_token_threshold
        return min(num_new, threshold) if threshold else num_new

    def _swap_in(self, out: ScheduledBatch, budget: int) -> int:
        num_sequences = _num_sequences(self.running)
        while self.swapped and budget > 0 and num_sequences < self.config.max_num_seqs:
            request = self.swapped[0]
            num_new = self._chunk(request, budget)
            if not self.kv_cache.allocate_slots(request, num_new, reserve=self.watermark_blocks):
                break
            self.swapped.popleft()
            cpu_blocks = self.swap_space.release(request.request_id)
            out.message.swap_in.extend(zip(cpu_blocks, self.kv_cache.block_table(request.request_id)))
            self.stats.num_swapped_in += 1
            num_sequences += _num_sequences([request])
            self._start(request, num_new, out)
            budget -= num_new
        return budget

    def _admit_waiting(self, out: ScheduledBatch, budget: int) -> None:
        """Admit from the front of the queue; a preempted group's members (a search's beams) come back all
        together or not at all (half a group would hold blocks while waiting for the other half). max_num_seqs
        counts the sequences a request forks into after its first step (n / best_of, a search's width), so a step
        never holds more than that many."""
        num_sequences = _num_sequences(self.running)
        while budget > 0:
            # a request whose grammar is still being compiled keeps its place; those behind it go on
            position = next((i for i, r in enumerate(self.waiting) if r.grammar_pending is None), None)
            if position is None:
                return
            head = self.waiting[position]
            queue = itertools.islice(self.waiting, position, None)
            group = list(itertools.takewhile(lambda r: r.group is head.group, queue)) if head.group else [head]
            wanted = _num_sequences(group)
            if num_sequences + wanted > self.config.max_num_seqs:
                return
            num_sequences += wanted
            admitted: list[tuple[Request, int, int]] = []  # request, new tokens, prefix-cache hit tokens
            for request in group:
                hit_tokens = self.kv_cache.match_prefix(request)
                request.num_computed_tokens = hit_tokens
                encoder_len = len(request.encoder_token_ids or ())  # its encoder runs beside its first chunk
                num_new = max(0, self._chunk(request, budget - encoder_len))
                admitted.append((request, num_new, hit_tokens))
                # a group member may start in a later step; anything else starts now or waits for a roomier step
                starts = num_new > 0 or not encoder_len or request.group is not None
                if not starts or not self.kv_cache.allocate_cross(request, reserve=self.watermark_blocks) or \
                        not self.kv_cache.allocate_slots(request, num_new, reserve=self.watermark_blocks):
                    for taken, _, hits in admitted:
                        self.kv_cache.undo_match(taken, hits)
                        taken.num_computed_tokens = 0
                    return
                budget -= num_new + (encoder_len if num_new else 0)
            for request, num_new, _ in admitted:
                del self.waiting[position]
                if request.metrics.first_scheduled_time is None:
                    request.metrics.first_scheduled_time = time.time()
                self._start(request, num_new, out)

    def _start(self, request: Request, num_new: int, out: ScheduledBatch) -> None:
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        if num_new:  # a group member admitted beyond the step's budget computes from the next step on
            out.scheduled.append(ScheduledRequest(request, num_new))

    def _allocate_or_preempt(self, request: Request, num_new: int, out: ScheduledBatch,
                             groups: list[list[Request]], index: int) -> bool:
        """Allocate, preempting the latest-admitted groups while short; False if groups[index] itself went."""
        while not self.kv_cache.allocate_slots(request, num_new):
            victims = groups.pop()
            for victim in reversed(victims):  # so they stand in the queue in their running order
                self.running.remove(victim)
                self._preempt(victim, out)
            if len(groups) == index:
                return False
        return True

    def _preempt(self, request: Request, out: ScheduledBatch) -> None:
        out.preempted.append(request)
        self.stats.num_preemptions += 1
        request.num_preemptions += 1
        table = self.kv_cache.block_table(request.request_id)
        if request.group is not None:  # what it reported is computed again, so it preempts by recompute
            request.group.forget(request)
        elif (self.config.preemption_mode == "swap" and self.swap_space is not None
                and request.encoder_token_ids is None  # its encoder runs again instead (cross blocks are not swapped)
                and self.swap_space.can_hold(len(table))):
            out.message.swap_out.extend(zip(table, self.swap_space.take(request.request_id, len(table))))
            self.kv_cache.free(request)
            request.status = RequestStatus.SWAPPED
            self.stats.num_swapped_out += 1
            self.swapped.appendleft(request)
            return
        # recompute (also the fallback when the CPU pool is full): its cached full blocks may still hit
        self.kv_cache.free(request)
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
        self.kv_cache.free(request)
        self.finished_ids.extend(request.worker_ids)


class AsyncScheduler(Scheduler):
    """Asynchronous scheduling: the next decode step can be scheduled while the step before it still runs."""

    def schedule_lookahead(self, in_flight: ScheduledBatch, sampled_ids: list[str]) -> ScheduledBatch | None:
        """The next step, scheduled while the step in flight still runs: each request that step samples decodes the
        token it samples (sampled_ids: the request of each sampled row; the worker takes the token from that step's
        samples; a request at its token limit after that token is left out, it finishes), a prompt that step computes
        a chunk of goes on with its next chunk, other running requests with theirs, then waiting requests are
        admitted with the budget left. Only where nothing needs the in-flight tokens on the host first (each sampling
        request samples one row, none is in a group or has logit controls: those read the tokens; a grammar's mask
        is filled after the in-flight tokens are read, while this step's forward pass runs),
        nothing is swapped out, and every chunk gets its blocks without preempting; otherwise None, and the next
        step is scheduled once the tokens are read."""
        flying = set(sampled_ids)
        if len(flying) != len(sampled_ids) or self.swapped or any(
                item.request.group is not None or item.request.sampling_params.controls_logits
                for item in in_flight.scheduled if item.samples):
            return None
        in_flight_chunks = {id(item.request): item.num_new_tokens for item in in_flight.scheduled if not item.samples}
        out = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        # decodes first (they are the latency), then chunks, as schedule() orders its budget
        for request in sorted(self.running, key=lambda r: r.request_id not in flying):
            if request.request_id in flying:
                if len(request.output_token_ids) + 1 >= request.max_tokens:
                    continue
                item = ScheduledRequest(request, 1, lookahead=True)
                ahead = request.num_tokens - request.num_computed_tokens + 1  # the in-flight token, then this one
            else:
                start = request.num_computed_tokens + in_flight_chunks.get(id(request), 0)
                num_new = self._chunk(request, budget, start)
                if num_new <= 0:
                    continue
                item = ScheduledRequest(request, num_new, start=start)
                ahead = start - request.num_computed_tokens + num_new
            if budget < item.num_new_tokens or not self.kv_cache.allocate_slots(request, ahead):
                return None  # what was taken stays in the tables: the next step needs it anyway
            out.scheduled.append(item)
            budget -= item.num_new_tokens
        if budget > 0:
            self._admit_waiting(out, budget)
        return self._with_message(out) if out.scheduled else None

def _num_sequences(requests: list[Request]) -> int:
    """The sequences these requests run as, or will once their first step forks them: a search counts its width,
    a request that has yet to draw its first token its best_of, any other request one."""
    total, groups = 0, set()
    for request in requests:
        if request.group is None:
            total += request.samples_to_draw
        elif id(request.group) not in groups:
            groups.add(id(request.group))
            total += request.group.width
    return total


def _groups(requests) -> list[list[Request]]:
    """Requests in order, the members of one sequence group gathered (they run and are preempted together);
    any other request is a group of its own."""
    groups: list[list[Request]] = []
    by_group: dict[int, list[Request]] = {}
    for request in requests:
        if request.group is None:
            groups.append([request])
        elif id(request.group) in by_group:
            by_group[id(request.group)].append(request)
        else:
            by_group[id(request.group)] = [request]
            groups.append(by_group[id(request.group)])
    return groups
