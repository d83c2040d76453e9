"""Engine: add_request / step / abort. One step = schedule, one forward pass, sample, detokenize."""
from __future__ import annotations

import logging
import time

from fasterllm.config import CacheConfig, EngineArgs, SchedulerConfig
from fasterllm.engine.beam_search import BeamSearch, advance_searches
from fasterllm.engine.engine_stats import EngineStats
from fasterllm.engine.input_processor import InputProcessor
from fasterllm.engine.kv_cache_manager import KVCacheManager, SwapSpace
from fasterllm.engine.limits import check_kv_cache_fits, resolve_max_model_len
from fasterllm.engine.output_processor import OutputProcessor
from fasterllm.engine.parallel_sampling import fork_sample, name_samples
from fasterllm.engine.request import Request
from fasterllm.engine.scheduler import AsyncScheduler, ScheduledBatch, Scheduler
from fasterllm.engine.sequence_forks import SequenceForks
from fasterllm.engine.stop_checker import check_stop
from fasterllm.engine.structured_output import StructuredOutputs
from fasterllm.errors import StepFailedError, WorkerFailedError
from fasterllm.executor import make_executor
from fasterllm.loader.checkpoint import open_checkpoint
from fasterllm.outputs import RequestOutput
from fasterllm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams
from fasterllm.worker.model_runner import PendingOutput
from fasterllm.worker.step_messages import GrammarMasks
from fasterllm.worker.worker import WorkerConfig

logger = logging.getLogger("fasterllm")


class Engine:
    def __init__(self, args: EngineArgs, text_elsewhere: bool = False):
        """text_elsewhere: this engine runs in a process of its own, and the server's process decodes the text of the
        requests that allow it (output_processor.text_decodable_elsewhere)."""
        args.validate()
        if args.data_parallel_size > 1:
            raise ValueError(f"data_parallel_size={args.data_parallel_size}: an Engine is one replica; data "
                             "parallelism runs replicas behind the server (fasterllm serve, AsyncLLM); use "
                             "data_parallel_size=1 here")
        start = time.perf_counter()
        self.args = args
        self.device = args.resolve_device()
        self.dtype = args.resolve_dtype(self.device)
        checkpoint = open_checkpoint(args.model, args.tokenizer)
        self.source = checkpoint.source
        self.model_name = checkpoint.source.name
        self.model_config = checkpoint.config
        self.tokenizer = checkpoint.tokenizer
        self.eos_token_ids = checkpoint.eos_token_ids
        positions = self.model_config.max_position_embeddings
        self.max_model_len = resolve_max_model_len(args.max_model_len, positions, positions,
                                                   f"max_position_embeddings={positions}")
        max_batched = args.max_num_batched_tokens or (8192 if self.device.type == "cuda" else 2048)
        encoder_decoder = self.model_config.is_encoder_decoder
        self.inputs = InputProcessor.for_model(self.tokenizer, self.model_config, self.max_model_len)
        self.scheduler_config = SchedulerConfig(
            args.max_num_seqs, max_batched, self.max_model_len, args.preemption_mode, args.watermark,
            long_prefill_token_threshold=args.long_prefill_token_threshold,
            max_prefill_tokens_beside_decodes=args.max_prefill_tokens_beside_decodes)
        self.executor = make_executor(WorkerConfig(args, self.max_model_len, self.scheduler_config, self.dtype),
                                      checkpoint)
        cache = CacheConfig(args.block_size)
        profile_start = time.perf_counter()
        cache.num_blocks = args.num_kv_blocks or self.executor.determine_num_blocks(
            cache, self.scheduler_config, args.gpu_memory_utilization, args.cpu_kv_cache_gib)
        check_kv_cache_fits(cache, self.max_model_len, self.device)
        swap_blocks = 0
        if args.preemption_mode == "swap":
            swap_blocks = int(args.swap_space_gib * 2**30) // self.executor.bytes_per_block(cache.block_size)
        profile_seconds = time.perf_counter() - profile_start
        graph_seconds = self.executor.initialize_cache(cache.num_blocks, cache.block_size, swap_blocks,
                                                       capture_graphs=not args.enforce_eager)
        # a decoder's KV depends on its encoder input too, which block hashes do not cover: no prefix caching there
        self.kv_cache = KVCacheManager(cache.num_blocks, cache.block_size,
                                       args.enable_prefix_caching and not encoder_decoder)
        swap_space = SwapSpace(swap_blocks) if args.preemption_mode == "swap" else None
        self.async_scheduling = self.device.type == "cuda" if args.async_scheduling is None else args.async_scheduling
        self.scheduler = (AsyncScheduler if self.async_scheduling else Scheduler)(
            self.scheduler_config, self.kv_cache, swap_space)
        self.output_processor = OutputProcessor(self.tokenizer, text_elsewhere)
        self.structured = StructuredOutputs(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        self.requests: dict[str, Request] = {}
        self.forks = SequenceForks(self.requests, self.kv_cache, self.scheduler, self.eos_token_ids, self.max_model_len)
        self._in_flight: tuple[ScheduledBatch, PendingOutput] | None = None  # launched, tokens not read
        self._failed_lookahead: tuple[ScheduledBatch, Exception] | None = None  # its masks could not be applied
        self.startup_seconds = {"total": time.perf_counter() - start, "weights": self.executor.load_seconds,
                                "kv_sizing": profile_seconds, "cuda_graphs": graph_seconds}
        logger.info("engine ready in %.1fs (weights %.1fs, KV sizing %.1fs, CUDA graphs %.1fs): %s, %s on %s, "
                    "%d KV blocks of %d tokens, max_model_len %d", self.startup_seconds["total"],
                    self.executor.load_seconds, profile_seconds, graph_seconds, self.model_name,
                    str(self.dtype).removeprefix("torch."), self.device, cache.num_blocks, cache.block_size,
                    self.max_model_len)

    # ---- requests -------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int] | dict,
                    params: SamplingParams | BeamSearchParams, arrival_time: float | None = None) -> Request:
        """Queue a request: sampling (SamplingParams) or a beam search (BeamSearchParams; its one output
        comes when the search ends, with the n best hypotheses). An encoder-decoder model's prompt is its encoder
        input, or {"encoder_prompt": ..., "decoder_prompt": ...}."""
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use; request ids must be unique")
        inputs = self.inputs.generation_inputs(prompt)
        search = None
        if isinstance(params, BeamSearchParams):
            search, params = BeamSearch(params, self.eos_token_ids), params.as_sampling_params()
        self.inputs.check_sampling_token_ids(params)
        request = Request(request_id, inputs.prompt, inputs.token_ids, params, self.eos_token_ids, self.max_model_len,
                          arrival_time, inputs.encoder_prompt, inputs.encoder_token_ids)
        name_samples(request)
        request.bad_word_ids = self.inputs.bad_word_ids(params.bad_words)
        if params.structured_outputs is not None:
            self.structured.start(request)
        if search is not None:
            search.start(request, self.kv_cache)
        self.scheduler.add_request(request)  # first: it may still refuse the request
        self.requests[request_id] = request
        if search is None:  # a beam's text is decoded once, when its search ends
            self.output_processor.add_request(request)
        return request

    def abort_request(self, request_id: str, reason: str = "abort") -> None:
        """End a request as added (with its parallel samples) and free its blocks."""
        request = self.requests.get(request_id)
        for member in [] if request is None else request.family:
            self.scheduler.finish_request(member, reason)
            self.requests.pop(member.request_id, None)
            self.output_processor.remove(member.request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ---- the loop -------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step; return an output for every request that produced a token or finished.

        With asynchronous scheduling, the next decode step is launched before this step's tokens are
        read: the host's work on them (detokenizing, stop checks, outputs) overlaps the GPU's next step. Where that
        step samples under a grammar, its forward pass runs meanwhile and it samples once this step's tokens have
        advanced the matchers and its masks are filled."""
        self._take_compiled_grammars()
        if self._failed_lookahead is not None:
            failed, self._failed_lookahead = self._failed_lookahead, None
            self._fail_batch(*failed)
        launched = self._in_flight or self._launch(self.scheduler.schedule())
        self._in_flight = None
        if launched is None:
            if self.structured.compiling:  # nothing else to run: a request waits for its grammar
                self.structured.wait_compiled(0.01)
            return []
        out, result = launched
        if self.async_scheduling:
            self._in_flight = self._launch_lookahead(out, result)
        masks_follow = self._in_flight is not None and self._in_flight[0].message.masks_follow
        try:
            outputs = self._finish_step(out, result)
        except BaseException:
            if masks_follow:  # its masks will not come: dropped (the worker drops it at the next step)
                self._in_flight = None
            raise
        if masks_follow:
            self._sample_lookahead_with_masks()
        return outputs

    def _take_compiled_grammars(self) -> None:
        """Requests whose grammar matcher is built may be scheduled; one that failed to build fails alone."""
        failed = self.structured.collect_compiled()
        if not failed:
            return
        ids = [request.request_id for request, _ in failed]
        for request_id in ids:
            self.abort_request(request_id, "error")
        raise StepFailedError(ids, failed[0][1])

    def _launch(self, batch: ScheduledBatch) -> tuple[ScheduledBatch, PendingOutput] | None:
        self.structured.attach_masks(batch)
        try:
            pending = self.executor.execute(batch.message)
        except WorkerFailedError:  # the ranks are gone: nothing goes on
            raise
        except Exception as exc:
            self._fail_batch(batch, exc)
        return None if pending is None else (batch, pending)

    def _fail_batch(self, batch: ScheduledBatch, exc: Exception) -> None:
        """A step that failed fails its requests (a failed sample its whole request: the samples not in this step
        too) and raises StepFailedError naming them. A request of the batch that has ended since (a lookahead's,
        aborted meanwhile) is not failed, nor a new request that took its id."""
        heads = [item.request.family[0] for item in batch.scheduled]
        ids = list(dict.fromkeys(head.request_id for head in heads if self.requests.get(head.request_id) is head))
        if not ids:
            logger.warning("a step of requests that have all ended since failed: %r", exc)
            return
        logger.error("step failed; failing requests %s", ids, exc_info=exc)
        for request_id in ids:
            self.abort_request(request_id, "error")
        raise StepFailedError(ids, exc) from exc

    def _launch_lookahead(self, batch: ScheduledBatch,
                          pending: PendingOutput) -> tuple[ScheduledBatch, PendingOutput] | None:
        """Schedule and launch the next step now, where the scheduler finds nothing needs this step's tokens on
        the host first: each decode row's input is this step's sampled id still on the device, prompt chunks go on,
        waiting requests are admitted. A request that then ends in this step wastes its lookahead row, which is
        dropped."""
        lookahead = self.scheduler.schedule_lookahead(batch, pending.request_ids)
        if lookahead is None:
            return None
        # a constrained row's mask needs the token this step samples for it: filled once that is read
        lookahead.message.masks_follow = self.structured.samples_constrained(lookahead)
        try:
            launched = self.executor.execute(lookahead.message)
        except WorkerFailedError:
            raise
        except Exception:  # nothing was accounted: the next step schedules every chunk again, synchronously
            logger.warning("a lookahead step failed to launch; continuing synchronously", exc_info=True)
            return None
        for item in lookahead.scheduled:
            if item.lookahead and item.request.group is not None:  # its slots follow the selection on the device
                item.request.group.followed = True
        return lookahead, launched

    def _sample_lookahead_with_masks(self) -> None:
        """The lookahead step's forward pass runs; now that this step's tokens advanced the matchers, fill its
        constrained rows' masks and let it sample."""
        batch, _ = self._in_flight
        self.structured.attach_masks(batch)
        try:
            self.executor.sample_with_masks(GrammarMasks(batch.message.grammar_rows, batch.message.grammar_bitmask))
        except WorkerFailedError:
            raise
        except Exception as exc:  # this step's outputs still go out: the lookahead's requests fail at the next step
            self._in_flight, self._failed_lookahead = None, (batch, exc)

    def _finish_step(self, batch: ScheduledBatch, pending: PendingOutput) -> list[RequestOutput]:
        """Read the step's tokens and account them: forks, beam searches, logprobs, stops, outputs."""
        result = pending.get()
        tokens = result.sampled_token_ids
        # a parent's extra rows (parallel sampling) become its children, sharing its blocks
        rows: list[Request | None] = []  # None: a lookahead row of a request that has ended since
        first_tokens: dict[str, int] = {}
        # by object, not id: a lookahead row's request may have ended and its id been added again since
        live = {item.request.request_id: item for item in batch.scheduled if not item.request.finished}
        for request_id, token in zip(result.request_ids, tokens):
            item = live.get(request_id)
            if item is None:
                rows.append(None)
                continue
            request = item.request
            if request_id in first_tokens:  # an extra row: a child continuing the parent's step
                request = fork_sample(self.forks, request, token, request.num_computed_tokens + item.num_new_tokens)
                self.output_processor.add_request(request)
            else:
                first_tokens[request_id] = token
            rows.append(request)
        self.scheduler.update(batch, first_tokens)
        ended_searches = advance_searches(batch, result.selection, self.scheduler, self.requests, self.tokenizer)
        self.output_processor.record_logprobs(rows, result)
        self.output_processor.record_prompt_logprobs(self.requests, result.prompt_logprobs)
        families: dict[str, Request] = {}  # head of each family that produced tokens, in row order
        for request in rows:
            if request is None:
                continue
            if request.matcher is not None:
                request.matcher.consume_token(request.output_token_ids[-1])
            stop = check_stop(request, self.output_processor)
            if stop is not None:
                self.scheduler.finish_request(request, *stop)
            head = request.family[0]
            families[head.request_id] = head
        outputs = []
        final_only = RequestOutputKind.FINAL_ONLY
        for head in families.values():
            if head.sampling_params.output_kind is final_only and not head.family_finished:
                continue  # no output until it ends: building one a step is a large batch's host work
            output = self.output_processor.make_output(head)
            outputs.append(output)
            if output.finished:
                for member in head.family:
                    del self.requests[member.request_id]
        return outputs + ended_searches

    def stats(self) -> EngineStats:
        return EngineStats.collect(self.kv_cache, self.scheduler)

    def shutdown(self) -> None:
        """Stop the executor's worker processes, if it has any (they stop by themselves when this process exits)."""
        self.executor.shutdown()
