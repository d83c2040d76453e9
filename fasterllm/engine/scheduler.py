"""Continuous batching under a token budget (vLLM v1's model).

Every step each scheduled request contributes some new tokens: a whole prompt, a chunk of one, or
the one token it sampled last step. Running requests go first (oldest first), then waiting ones
are admitted while the token budget, max_num_seqs and the block pool allow. When blocks run out,
the latest-admitted running request is preempted by recompute: its blocks are freed and it goes
back to the front of the queue, keeping the tokens it generated.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from fasterllm.config import SchedulerConfig
from fasterllm.engine.kv_cache_manager import KVCacheManager
from fasterllm.engine.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    samples: bool = field(init=False)  # this chunk reaches the last known token: the step yields a new one

    def __post_init__(self) -> None:
        self.samples = self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager):
        self.config = config
        self.kv_cache = kv_cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._allocate_or_preempt(request, num_new, out):
                break  # the request itself was preempted: nothing after it runs either
            out.scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
            index += 1
        # admitting new work in a step that had to preempt would only thrash
        while (not out.preempted and self.waiting and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            request = self.waiting[0]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self.kv_cache.allocate_slots(request, num_new):
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = time.time()
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
        return out

    def _allocate_or_preempt(self, request: Request, num_new: int, out: SchedulerOutput) -> bool:
        while not self.kv_cache.allocate_slots(request, num_new):
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        self.kv_cache.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def update(self, out: SchedulerOutput, sampled: dict[str, int]) -> None:
        """Account the computed tokens, append sampled ones, and release requests that hit a token stop."""
        now = time.time()
        for item in out.scheduled:
            request = item.request
            request.num_computed_tokens += item.num_new_tokens
            token = sampled.get(request.request_id)
            if token is None:
                continue
            request.append_token(token)
            request.metrics.first_token_time = request.metrics.first_token_time or now
            request.metrics.last_token_time = now
            if request.check_token_stop():
                self._release(request)

    def finish_request(self, request: Request, reason: str, stop_reason: int | str | None = None) -> None:
        """End a request early (a stop string, an abort): it leaves its queue and frees its blocks."""
        if request.finished:
            return
        request.finish(reason, stop_reason)
        if request in self.waiting:
            self.waiting.remove(request)
        self._release(request)

    def _release(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        self.kv_cache.free(request)
