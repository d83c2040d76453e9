"""Engine: add_request / step / abort. One step = schedule, one forward pass, sample, detokenize."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from fasterllm.config import CacheConfig, EngineArgs, SchedulerConfig
from fasterllm.engine.kv_cache_manager import KVCacheManager, SwapSpace
from fasterllm.engine.output_processor import OutputProcessor
from fasterllm.engine.request import Request
from fasterllm.engine.scheduler import Scheduler
from fasterllm.loader.checkpoint import open_checkpoint
from fasterllm.outputs import RequestOutput
from fasterllm.sampling_params import SamplingParams
from fasterllm.worker.model_runner import ModelRunner

logger = logging.getLogger("fasterllm")


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_swapped: int
    kv_cache_usage: float  # fraction of blocks referenced by requests
    num_kv_blocks: int
    num_cached_blocks: int  # blocks findable by prefix hash (in use or free)
    prefix_cache_queries: int  # prompt tokens looked up
    prefix_cache_hits: int  # of which found cached
    num_preemptions: int
    num_swapped_out: int
    num_swapped_in: int

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


class Engine:
    def __init__(self, args: EngineArgs):
        args.validate()
        start = time.perf_counter()
        self.args = args
        self.device = args.resolve_device()
        self.dtype = args.resolve_dtype(self.device)
        torch.manual_seed(args.seed)
        checkpoint = open_checkpoint(args.model, args.tokenizer)
        self.source = checkpoint.source
        self.model_name = checkpoint.source.name
        self.model_config = checkpoint.config
        self.tokenizer = checkpoint.tokenizer
        self.max_model_len = self._max_model_len(args.max_model_len)
        max_batched = args.max_num_batched_tokens or (8192 if self.device.type == "cuda" else 2048)
        self.scheduler_config = SchedulerConfig(args.max_num_seqs, max_batched, self.max_model_len,
                                                args.preemption_mode, args.watermark,
                                                args.long_prefill_token_threshold)
        self.runner = ModelRunner(checkpoint, self.max_model_len, self.device, self.dtype)
        cache = CacheConfig(args.block_size)
        profile_start = time.perf_counter()
        cache.num_blocks = args.num_kv_blocks or self.runner.determine_num_blocks(
            cache, self.scheduler_config, args.gpu_memory_utilization, args.cpu_kv_cache_gib)
        self._check_fits(cache)
        self.runner.allocate_kv_cache(cache.num_blocks, cache.block_size)
        self.kv_cache = KVCacheManager(cache.num_blocks, cache.block_size, args.enable_prefix_caching)
        swap_space = None
        if args.preemption_mode == "swap":
            cpu_blocks = int(args.swap_space_gib * 2**30) // self.runner.bytes_per_block(cache.block_size)
            self.runner.allocate_swap_space(cpu_blocks)
            swap_space = SwapSpace(cpu_blocks)
        self.scheduler = Scheduler(self.scheduler_config, self.kv_cache, swap_space)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.requests: dict[str, Request] = {}
        logger.info("engine ready in %.1fs (weights %.1fs, KV sizing %.1fs): %s, %s on %s, %d KV blocks of %d tokens, "
                    "max_model_len %d", time.perf_counter() - start, self.runner.load_seconds,
                    time.perf_counter() - profile_start, self.model_name, str(self.dtype).removeprefix("torch."),
                    self.device, cache.num_blocks, cache.block_size, self.max_model_len)

    def _max_model_len(self, requested: int | None) -> int:
        limit = self.model_config.max_position_embeddings
        if requested is None:
            return limit
        if requested > limit:
            raise ValueError(f"max_model_len={requested} exceeds the model's max_position_embeddings={limit}; "
                             f"use max_model_len <= {limit}")
        return requested

    def _check_fits(self, cache: CacheConfig) -> None:
        needed = -(-self.max_model_len // cache.block_size)
        if cache.num_blocks >= needed:
            return
        fix = ("raise gpu_memory_utilization" if self.device.type == "cuda"
               else "raise cpu_kv_cache_gib (--cpu-kv-cache-gib)")
        raise ValueError(
            f"The KV cache has {cache.num_blocks} blocks ({cache.num_blocks * cache.block_size} tokens) but one request "
            f"of max_model_len={self.max_model_len} needs {needed} blocks. Lower max_model_len (--max-model-len) "
            f"to at most {cache.num_blocks * cache.block_size}, or {fix}.")

    # ---- requests -------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None) -> Request:
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use; request ids must be unique")
        text, token_ids = self._tokenize(prompt)
        self._check_token_ids(params)
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        request = Request(request_id, text, token_ids, params, self.tokenizer.eos_token_ids or
                          self.model_config.eos_token_ids, self.max_model_len, arrival_time, generator)
        request.bad_word_ids = self._bad_word_ids(params.bad_words)
        self.scheduler.add_request(request)  # first: it may still refuse the request
        self.requests[request_id] = request
        self.output_processor.add_request(request)
        return request

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("The prompt is empty; give at least one character (or token id)")
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, token_ids = None, list(prompt)
            vocab = self.model_config.vocab_size
            bad = [t for t in token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt token ids {bad[:5]} are not valid: ids must be integers in [0, {vocab})")
        if not token_ids:
            raise ValueError("The prompt has no tokens; give at least one")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"The prompt has {len(token_ids)} tokens but max_model_len is {self.max_model_len} "
                             "(room for at least one generated token is needed); shorten the prompt or raise "
                             "max_model_len (--max-model-len)")
        return text, token_ids

    def _bad_word_ids(self, words: list[str] | None) -> list[list[int]]:
        """Each bad word as token ids, as written and with a leading space (how it appears mid-text)."""
        sequences: list[list[int]] = []
        for word in words or []:
            for form in (word, " " + word.lstrip()):
                ids = self.tokenizer.encode(form, add_special_tokens=False)
                if ids and ids not in sequences:
                    sequences.append(ids)
        return sequences

    def _check_token_ids(self, params: SamplingParams) -> None:
        vocab = self.model_config.vocab_size
        for name, ids in (("stop_token_ids", params.stop_token_ids), ("allowed_token_ids", params.allowed_token_ids),
                          ("logit_bias", list(params.logit_bias or {}))):
            bad = [t for t in ids or [] if t >= vocab]
            if bad:
                raise ValueError(f"{name} has token ids {bad[:5]} outside the vocabulary [0, {vocab})")

    def abort_request(self, request_id: str) -> None:
        request = self.requests.pop(request_id, None)
        if request is not None:
            self.scheduler.finish_request(request, "abort")
            self.output_processor.remove(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ---- the loop -------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step; return an output for every request that produced a token or finished."""
        out = self.scheduler.schedule()
        if out.swap_out or out.swap_in:  # before anything can overwrite the blocks a swap-out frees
            self.runner.swap(out)
        if not out.scheduled:
            return []
        try:
            result = self.runner.execute(out, self.kv_cache.block_tables)
        except Exception:
            ids = [item.request.request_id for item in out.scheduled]
            logger.exception("forward pass failed; failing requests %s", ids)
            for item in out.scheduled:
                self.scheduler.finish_request(item.request, "error")
                self.requests.pop(item.request.request_id, None)
                self.output_processor.remove(item.request.request_id)
            raise
        sampled = result.sampler_output
        tokens = sampled.token_ids.tolist() if sampled is not None else []
        self.scheduler.update(out, dict(zip(result.request_ids, tokens)))
        if sampled is not None and sampled.logprobs is not None:
            self._record_logprobs(result.request_ids, sampled)
        self._record_prompt_logprobs(result.prompt_logprobs)
        outputs = []
        for request_id, token in zip(result.request_ids, tokens):
            request = self.requests[request_id]
            stop = self.output_processor.new_tokens(request, [token])
            if stop is not None:
                self.scheduler.finish_request(request, "stop", stop)
            outputs.append(self.output_processor.make_output(request))
            if request.finished:
                del self.requests[request_id]
        return outputs

    def _record_logprobs(self, request_ids: list[str], sampled) -> None:
        ids, values, ranks = sampled.logprob_token_ids.tolist(), sampled.logprobs.tolist(), sampled.sampled_ranks.tolist()
        for row, request_id in enumerate(request_ids):
            request = self.requests[request_id]
            wanted = request.sampling_params.logprobs
            if wanted is None:
                continue
            request.logprobs.append(self.output_processor.decode_logprobs(ids[row], values[row], ranks[row], wanted))
            request.cumulative_logprob += values[row][0]

    def _record_prompt_logprobs(self, scored: dict) -> None:
        for request_id, (start, ids, values, ranks) in scored.items():
            request = self.requests[request_id]
            wanted = request.sampling_params.prompt_logprobs
            for offset, (row_ids, row_values, rank) in enumerate(zip(ids, values, ranks)):
                if len(request.prompt_logprobs) == start + offset + 1:  # a recompute scores positions again
                    request.prompt_logprobs.append(
                        self.output_processor.decode_logprobs(row_ids, row_values, rank, wanted))

    def stats(self) -> EngineStats:
        kv, sched = self.kv_cache, self.scheduler
        return EngineStats(len(sched.running), len(sched.waiting), len(sched.swapped), kv.usage, kv.num_blocks,
                           kv.num_cached_blocks, kv.prefix_cache_queries, kv.prefix_cache_hits,
                           sched.stats.num_preemptions, sched.stats.num_swapped_out, sched.stats.num_swapped_in)
