"""Requests that continue another request's tokens, sharing its KV blocks copy-on-write: the parallel samples of
an n / best_of request (parallel_sampling.py). An encoder-decoder request's forks share its cross-attention blocks
too (read only, never copied)."""
from __future__ import annotations

from fasterllm.engine.kv_cache_manager import KVCacheManager
from fasterllm.engine.request import Request
from fasterllm.engine.scheduler import Scheduler


class SequenceForks:
    def __init__(self, requests: dict[str, Request], kv_cache: KVCacheManager, scheduler: Scheduler,
                 eos_token_ids: list[int], max_model_len: int):
        self.requests = requests  # the engine's: a fork is registered there
        self.kv_cache, self.scheduler = kv_cache, scheduler
        self.eos_token_ids, self.max_model_len = eos_token_ids, max_model_len

    def fork(self, parent: Request, child_id: str, first_token: int, num_computed_tokens: int) -> Request:
        """A request continuing the parent's tokens with first_token, sharing its blocks copy-on-write.

        Called before the step's bookkeeping, so num_computed_tokens is the parent's after this step.
        """
        child = Request(child_id, parent.prompt, parent.prompt_token_ids, parent.sampling_params, self.eos_token_ids,
                        self.max_model_len, parent.metrics.arrival_time, parent.encoder_prompt,
                        parent.encoder_token_ids)
        child.output_token_ids = list(parent.output_token_ids)
        child.all_token_ids = list(parent.all_token_ids)
        child.bad_word_ids = parent.bad_word_ids
        child.matcher = parent.matcher.deep_copy() if parent.matcher is not None else None
        child.num_computed_tokens = num_computed_tokens
        child.metrics.first_scheduled_time = parent.metrics.first_scheduled_time
        self.kv_cache.fork(parent, child)
        self.requests[child.request_id] = child
        self.scheduler.add_forked(child, first_token)
        return child
