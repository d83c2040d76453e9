"""The device side: holds the model and the KV cache, turns a step message into one forward pass.

It reads nothing of the engine's: each SchedulerOutput updates its own copy of the requests
(worker/request_states.py), and it answers with a plain ModelRunnerOutput (worker/step_messages.py).
"""
from __future__ import annotations

import logging
import time

import torch

from fasterllm.config import CacheConfig, KVCacheSpec, ModelConfig, SchedulerConfig
from fasterllm.distributed.tensor_parallel import SINGLE_DEVICE, TensorParallel
from fasterllm.layers.attention import AttentionMetadata
from fasterllm.kernels.block_copy import copy_blocks_on_host
from fasterllm.layers.kv_cache_dtype import FP8_KV_DTYPE
from fasterllm.loader.checkpoint import Checkpoint
from fasterllm.worker.beam_follow import FollowingSlots, PreviousSelection, follow_on_device, follow_on_host
from fasterllm.worker.beam_search import PendingSelection, select_beams, stage_search_rows
from fasterllm.worker.beam_selection_graphs import SelectionGraphs
from fasterllm.worker.cross_encoder_graphs import CrossEncoderGraphs
from fasterllm.worker.cuda_graphs import DecodeGraphs
from fasterllm.worker.decoder_builder import build_decoder
from fasterllm.worker.encoder_decoder_inputs import encode_starting, run_encoders
from fasterllm.worker.input_buffers import InputBuffers, host_to_device
from fasterllm.worker.logit_controls import LogitControls
from fasterllm.worker.piecewise_graphs import PiecewiseGraphs
from fasterllm.worker.prompt_logprobs import score_prompt_positions
from fasterllm.worker.request_states import RequestState, RequestStates
from fasterllm.worker.sampler import SamplerOutput, SamplingMetadata, sample
from fasterllm.worker.step_messages import GrammarMasks, ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


class PendingOutput:
    """A launched step's output: get() waits for its samples to reach the host and returns them as plain lists.
    On a GPU the copy was queued right behind the step's sampling, so get() waits for that step only, not for
    a step launched after it. A step run with masks_follow has its samples once sample_with_masks has run."""

    def __init__(self, request_ids: list[str], sampled: SamplerOutput | None, prompt_logprobs: dict,
                 selection: PendingSelection | None = None):
        self.request_ids, self.sampled, self.prompt_logprobs = request_ids, sampled, prompt_logprobs
        self.selection = selection  # the beam searches' selection

    def get(self) -> ModelRunnerOutput:
        sampled = self.sampled
        selection = None if self.selection is None else self.selection.on_host()
        if sampled is None:
            if self.request_ids:
                raise RuntimeError("this step's rows wait for their grammar masks: sample_with_masks first")
            return ModelRunnerOutput([], [], prompt_logprobs=self.prompt_logprobs, selection=selection)
        output = ModelRunnerOutput(self.request_ids, sampled.host("token_ids").tolist(),
                                   prompt_logprobs=self.prompt_logprobs, selection=selection)
        if sampled.logprobs is not None:
            output.logprob_token_ids, output.logprobs, output.sampled_ranks = (
                sampled.host(name).tolist() for name in ("logprob_token_ids", "logprobs", "sampled_ranks"))
        return output


class ModelRunner:
    def __init__(self, checkpoint: Checkpoint, max_model_len: int, device: torch.device, dtype: torch.dtype,
                 load_format: str = "auto", quantization: str | None = None, tp: TensorParallel = SINGLE_DEVICE,
                 cache_dtype: torch.dtype | None = None):
        """cache_dtype: the KV cache's (float8_e4m3fn: fp8 K/V with the attention layers' scales, the checkpoint's
        where it carries them, else 1.0); None: dtype."""
        self.model_config: ModelConfig = checkpoint.config
        self.device, self.dtype = device, dtype
        self.cache_dtype = cache_dtype or dtype
        start = time.perf_counter()
        self.model = build_decoder(checkpoint, max_model_len, device, dtype, load_format, quantization, tp=tp)
        if self.cache_dtype == FP8_KV_DTYPE and checkpoint.kv_cache_scales is not None:
            # floats fixed for the engine's life, set before any CUDA graph captures them as kernel arguments
            self.model.set_kv_cache_scales(checkpoint.kv_cache_scales)
        self.kv_specs = _cache_layers(self.model.kv_cache_specs())
        self.encoder_decoder = self.model_config.is_encoder_decoder
        self.load_seconds = time.perf_counter() - start
        self.max_model_len = max_model_len
        self.kv_caches: torch.Tensor | None = None
        self.swap_caches: torch.Tensor | None = None  # the CPU pool for preemption by swap
        self.block_size = 0
        self.buffers: InputBuffers | None = None  # GPU: fixed input buffers, filled from pinned memory
        self.graphs: DecodeGraphs | None = None
        self.piecewise: PiecewiseGraphs | None = None  # steps with prompt chunks (decoder-only models)
        self.selection_graphs: SelectionGraphs | None = None  # beam searches' selections
        self.encoder_graphs: CrossEncoderGraphs | None = None  # an encoder-decoder model's encoder passes
        self.previous_selection: PreviousSelection | None = None  # the last step's, which a lookahead step follows
        self.requests = RequestStates(device)
        # the last step's sampled ids, still on the device, and the request of each row: a step scheduled before
        # the engine read them (asynchronous scheduling) takes a request's next input token from here
        self.previous_samples: tuple[torch.Tensor, list[str]] | None = None
        # a step run with masks_follow: (its output, its rows' logits, its message) until sample_with_masks
        self.awaiting_masks: tuple[PendingOutput, torch.Tensor, SchedulerOutput] | None = None

    def prepare_inputs(self, block_size: int, sched: SchedulerConfig) -> None:
        """On a GPU, the fixed buffers every step's inputs are staged into (the Triton kernels' path)."""
        if self.device.type == "cuda":
            longest = max(self.max_model_len, sched.max_num_batched_tokens)
            cross_blocks = -(-self.model_config.max_encoder_len // block_size) if self.encoder_decoder else 0
            self.buffers = InputBuffers(sched.max_num_batched_tokens, sched.max_num_seqs, -(-longest // block_size),
                                        block_size, self.device, cross_blocks)

    def initialize_cache(self, num_blocks: int, block_size: int, swap_blocks: int, capture_graphs: bool) -> float:
        """Allocate the KV cache (and the CPU swap pool, swap_blocks > 0), then capture the decode CUDA graphs (and a
        decoder-only model's piecewise ones) where the step runs the GPU's kernels and capture_graphs; returns the
        seconds the capture took."""
        self.allocate_kv_cache(num_blocks, block_size)
        if swap_blocks:
            self.allocate_swap_space(swap_blocks)
        if self.buffers is None or not capture_graphs:
            return 0.0
        self.graphs = DecodeGraphs(self.model, self.buffers, self.kv_caches, self.encoder_decoder)
        seconds = self.graphs.capture()
        self.selection_graphs = SelectionGraphs(self.device)  # captured when first needed
        if self.encoder_decoder and self.model.replayable_encoder:
            self.encoder_graphs = CrossEncoderGraphs(self.model, self.kv_caches, self.device,
                                                     self.model_config.max_encoder_len)
            seconds += self.encoder_graphs.capture(self.buffers.max_tokens, self.buffers.max_seqs)
        if not self.encoder_decoder:
            self.piecewise = PiecewiseGraphs(self.model, self.buffers, self.kv_caches)
            seconds += self.piecewise.capture()
        return seconds

    def bytes_per_block(self, block_size: int) -> int:
        return block_size * sum(spec.bytes_per_token(self.cache_dtype) for spec in self.kv_specs)

    def determine_num_blocks(self, cache: CacheConfig, sched: SchedulerConfig, gpu_memory_utilization: float,
                             cpu_kv_cache_gib: float) -> int:
        """Blocks that fit the KV budget: measured after a profiling pass on a GPU, configured on the CPU."""
        per_block = self.bytes_per_block(cache.block_size)
        if self.device.type != "cuda":
            return int(cpu_kv_cache_gib * 2**30) // per_block
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self.profile_run(cache.block_size, sched)
        free, total = torch.cuda.mem_get_info(self.device)
        # what others hold + our weights + the activations' peak must stay inside the fraction
        used_by_others = total - free - torch.cuda.memory_reserved(self.device)
        budget = total * gpu_memory_utilization - used_by_others - torch.cuda.max_memory_allocated(self.device)
        logger.info("profile: peak %.2f GiB, KV budget %.2f GiB",
                    torch.cuda.max_memory_allocated(self.device) / 2**30, budget / 2**30)
        torch.cuda.empty_cache()
        return max(int(budget) // per_block, 0)

    @torch.inference_mode()
    def profile_run(self, block_size: int, sched: SchedulerConfig) -> None:
        """One forward pass at the largest batch shape: max_num_batched_tokens over max_num_seqs prompts."""
        num_seqs = max(1, min(sched.max_num_seqs, sched.max_num_batched_tokens))
        lens = [sched.max_num_batched_tokens // num_seqs] * num_seqs
        lens[-1] += sched.max_num_batched_tokens - sum(lens)
        blocks_each = [-(-n // block_size) for n in lens]
        tables, next_block = [], 0
        for count in blocks_each:
            tables.append(list(range(next_block, next_block + count)))
            next_block += count
        self.allocate_kv_cache(next_block, block_size)
        last_rows = [sum(lens[:i + 1]) - 1 for i in range(len(lens))]
        cross = None
        if self.encoder_decoder:  # as many encoder tokens as fit its positions, their K/V in the same blocks
            encoder_lens = [min(n, self.model_config.max_encoder_len) for n in lens]
            cross_tables = [table[:-(-n // block_size)] for table, n in zip(tables, encoder_lens)]
            run_encoders(self.model, [[0] * n for n in encoder_lens], cross_tables, self.kv_caches, block_size,
                         self.device)
            cross = (encoder_lens, cross_tables)
        self._forward([0] * sum(lens), lens, lens, tables, last_rows, cross=cross)
        self.kv_caches = None

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        """One [layers, 2, blocks, block_size, kv heads, head dim] tensor: a block id means the same slots in every
        layer (a cross-attention layer shares its decoder layer's tensor: a block holds one group's tokens)."""
        spec = self.kv_specs[0]
        self.block_size = block_size
        self.kv_caches = torch.zeros(len(self.kv_specs), 2, num_blocks, block_size, spec.num_kv_heads, spec.head_dim,
                                     dtype=self.cache_dtype, device=self.device)

    def allocate_swap_space(self, num_blocks: int) -> None:
        shape = list(self.kv_caches.shape)
        shape[2] = num_blocks
        self.swap_caches = torch.zeros(shape, dtype=self.cache_dtype, pin_memory=self.device.type == "cuda")

    @torch.inference_mode()
    def move_blocks(self, out: SchedulerOutput) -> None:
        """Before the forward pass: preempted requests' blocks to the CPU pool, copy-on-write copies,
        then returning requests' blocks back (in that order: a block freed by a swap-out is read first). Blocks
        move as bytes, whatever the cache's dtype (torch's CPU indexing has no fp8 kernels)."""
        caches = self.kv_caches.view(torch.uint8)
        if out.swap_out:
            device_blocks, cpu_blocks = (torch.tensor(c) for c in zip(*out.swap_out))
            self.swap_caches.view(torch.uint8)[:, :, cpu_blocks] = caches[:, :, device_blocks.to(self.device)].cpu()
        if out.copies and self.device.type == "cuda":
            sources, destinations = (torch.tensor(c, device=self.device) for c in zip(*out.copies))
            # gathered then scattered: about 2x faster than an indexed assignment (beam search copies many a step)
            caches.index_copy_(2, destinations, caches.index_select(2, sources))
        elif out.copies:
            copy_blocks_on_host(self.kv_caches, out.copies)
        if out.swap_in:
            cpu_blocks, device_blocks = (torch.tensor(c) for c in zip(*out.swap_in))
            caches[:, :, device_blocks.to(self.device)] = self.swap_caches.view(torch.uint8)[:, :, cpu_blocks].to(
                self.device)

    @torch.inference_mode()
    def execute(self, message: SchedulerOutput) -> PendingOutput | None:
        """One step: take in the message, make its block copies, run the scheduled chunks and sample.
        None when nothing was scheduled."""
        self.awaiting_masks = None  # a step whose masks never came (the engine dropped it) is dropped too
        self.requests.update(message)
        if message.swap_out or message.swap_in or message.copies:  # before the forward pass writes into any
            self.move_blocks(message)
        if not message.runs_anything:
            return None
        searches = message.searches
        token_ids: list[int] = []
        query_lens, seq_lens, tables = [], [], []
        logits_rows: list[int] = []
        sampling = message.sampled_request_ids  # the request of each sampled row
        prompt_rows: list[tuple[str, RequestState, int, int, int]] = []  # id, state, first position, first row, count
        carried: list[tuple[int, str]] = []  # (token row, request) whose input is the previous step's sample
        states = self.requests.states
        scheduled_states: list[RequestState] = []
        for request_id, start, num_new, num_samples in zip(message.request_ids, message.starts,
                                                          message.num_new_tokens, message.num_samples):
            state = states[request_id]
            scheduled_states.append(state)
            end = start + num_new
            token_ids.extend(state.token_ids[start:end])
            if end > len(state.token_ids):  # the previous step's sample, not read by the engine yet
                carried.append((len(token_ids), request_id))
                token_ids.append(0)  # replaced on the device
            query_lens.append(num_new)
            seq_lens.append(end)
            tables.append(state.block_table)
            scored_end = min(end, state.num_prompt_tokens - 1)  # positions that predict a prompt token
            if state.sampling_params.prompt_logprobs is not None and start < scored_end:
                prompt_rows.append((request_id, state, start, len(token_ids) - num_new, scored_end - start))
            logits_rows.extend([len(token_ids) - 1] * num_samples)
        cross = None
        if self.encoder_decoder:
            cross = ([len(s.encoder_token_ids) for s in scheduled_states],
                     [s.cross_block_table for s in scheduled_states])
        previous = self.previous_selection
        search_rows = stage_search_rows(searches, self.requests.searches, token_ids, query_lens, seq_lens, tables,
                                        cross, previous, self.block_size)
        following = (search_rows.following, previous) if search_rows.following.widths else None
        logits_rows.extend(search_rows.logits_rows)  # the beam searches' rows go after the sampling rows
        for *_, first_row, count in prompt_rows:  # then the prompt-scoring rows
            logits_rows.extend(range(first_row, first_row + count))
        if self.encoder_decoder:
            encode_starting(self.model, [s for s, start in zip(scheduled_states, message.starts) if start == 0]
                            + search_rows.starting, self.kv_caches, self.block_size, self.device, self.encoder_graphs)
        logits = self._forward(token_ids, query_lens, seq_lens, tables, logits_rows, self._carried_inputs(carried),
                               cross, _rows_and_changes(message), following)
        selecting = len(sampling) + len(search_rows.logits_rows)
        prompt_logprobs = score_prompt_positions(logits[selecting:], prompt_rows)
        selection = None
        if search_rows.logits_rows:
            select_now = select_beams if self.selection_graphs is None else self.selection_graphs.select
            selection = select_now(logits[len(sampling):selecting], searches, self.requests.searches, previous)
        self.previous_selection = None if selection is None else selection.on_device
        pending = PendingOutput(sampling, None, prompt_logprobs, selection)
        if not sampling:
            return pending
        if message.masks_follow:
            self.awaiting_masks = (pending, logits[:len(sampling)], message)
        else:
            self._launch_sampling(pending, logits[:len(sampling)], message)
        return pending

    @torch.inference_mode()
    def sample_with_masks(self, masks: GrammarMasks) -> PendingOutput:
        """Sample the step executed with masks_follow, under its grammar masks."""
        if self.awaiting_masks is None:
            raise RuntimeError("grammar masks came for no step: the last step was not sent with masks_follow")
        (pending, logits, message), self.awaiting_masks = self.awaiting_masks, None
        message.grammar_rows, message.grammar_bitmask = masks.rows, masks.bitmask
        self._launch_sampling(pending, logits, message)
        return pending

    def _launch_sampling(self, pending: PendingOutput, logits: torch.Tensor, message: SchedulerOutput) -> None:
        sampled = self._sample(logits, pending.request_ids, message)
        if self.device.type == "cuda":
            sampled.copy_to_host_async()
        self.previous_samples = (sampled.token_ids, pending.request_ids)
        pending.sampled = sampled

    def _sample(self, logits: torch.Tensor, sampling: list[str], message: SchedulerOutput) -> SamplerOutput:
        states = [self.requests.states[request_id] for request_id in sampling]
        vocab = logits.shape[-1]
        md = SamplingMetadata.build([s.sampling_params for s in states], self.requests.row_generators(sampling),
                                    vocab, self.device, LogitControls.build(states, vocab, self.device))
        if message.grammar_bitmask is not None:
            md.allowed = _allowed_tokens(message.grammar_rows, message.grammar_bitmask, len(sampling), vocab,
                                         self.device)
        unchanged = md.controls is None and md.allowed is None  # the argmax of a decode graph's logits as they are
        return sample(logits, md, self.graphs.argmax(logits) if self.graphs is not None and unchanged else None)

    def _carried_inputs(self, carried: list[tuple[int, str]]) -> tuple[torch.Tensor | slice, torch.Tensor] | None:
        """Rows whose input is the previous step's sample: (their token rows, a slice where they are the first rows,
        and the ids gathered on the device)."""
        if not carried:
            return None
        samples, sampled_ids = self.previous_samples
        token_rows, requests = zip(*carried)
        # a request's row is its only one: a step where best_of gives one several is never looked ahead of
        if requests == tuple(sampled_ids[:len(requests)]):  # a decode batch as the step before sampled it
            ids = samples[:len(requests)]
        else:
            row_of = {request_id: row for row, request_id in enumerate(sampled_ids)}
            ids = samples[host_to_device([row_of[r] for r in requests], torch.long, self.device)]
        if token_rows == tuple(range(len(token_rows))):  # every row a decode row: the first rows, no index to send
            return slice(0, len(token_rows)), ids
        return host_to_device(list(token_rows), torch.long, self.device), ids

    def _forward(self, token_ids: list[int], query_lens: list[int], seq_lens: list[int], tables: list[list[int]],
                 logits_rows: list[int], carried: tuple[torch.Tensor | slice, torch.Tensor] | None = None,
                 cross: tuple[list[int], list[list[int]]] | None = None,
                 rows: tuple[tuple, list[int]] | None = None,
                 following: tuple[FollowingSlots, PreviousSelection] | None = None) -> torch.Tensor:
        """One forward pass -> fp32 logits of logits_rows: a CUDA graph for a decode batch that has one, piecewise
        graphs (attention eager between them) for a step of up to 512 tokens, the Triton kernels eagerly for any other
        batch on a GPU, the torch path on the CPU. carried: (token rows, or a slice of the first rows, and their ids
        on the device) written over those rows' placeholder ids before the pass. cross: an encoder-decoder model's
        (encoder lengths, cross tables) of the same sequences. rows: (what each row is: the requests, the searches and
        their slots, the rows whose tables changed this step): a decode batch of the same rows as the graph step
        before it only moves that step's inputs on. following: beam
        search slots whose inputs and tables follow the previous step's selection (worker/beam_follow.py)."""
        if self.buffers is None:
            if following is not None:
                follow_on_host(*following, token_ids, tables, self.kv_caches)
            meta = AttentionMetadata.build(query_lens, seq_lens, tables, self.block_size, self.device,
                                           self.model_config.sliding_window)
            if cross is not None:
                meta.cross = AttentionMetadata.build_cross(query_lens, *cross, self.block_size, self.device)
            input_ids = torch.tensor(token_ids, device=self.device)
            if carried is not None:
                input_ids[carried[0]] = carried[1]
            return self.model(input_ids, meta.positions, self.kv_caches, meta,
                              torch.tensor(logits_rows, dtype=torch.long, device=self.device))
        num_seqs = len(query_lens)
        decode = len(token_ids) == num_seqs and logits_rows == list(range(num_seqs))
        size = self.graphs.padded_size(num_seqs) if self.graphs is not None and decode else None
        tokens = self.piecewise.padded_size(len(token_ids)) if self.piecewise is not None and size is None else None
        identity = None if size is None or rows is None else (rows[0], size)
        if identity is not None and self.buffers.continues(identity, seq_lens):
            changed = [(row, tables[row]) for row in rows[1]]
            # every row's input the previous step's sample, in its row (carried's first rows)
            every_row_carried = carried is not None and isinstance(carried[0], slice) and carried[0].stop == num_seqs
            batch = self.buffers.advance_decode(token_ids, changed, carried[1] if every_row_carried else None)
            carried = None if every_row_carried else carried
        else:
            batch = self.buffers.stage(token_ids, query_lens, seq_lens, tables, logits_rows, padded_seqs=size,
                                       cross=cross, padded_tokens=tokens, identity=identity)
        if carried is not None:  # after the staging copy, on the same stream
            batch.input_ids[carried[0]] = carried[1]
        if following is not None:
            follow_on_device(*following, batch.input_ids, batch.meta.kernel.block_tables, self.kv_caches)
        if size is not None:
            return self.graphs.replay(size, num_seqs)
        if tokens is not None:
            return self.piecewise.replay(tokens, batch.meta.kernel, batch.logits_indices)
        return self.model(batch.input_ids, batch.meta.positions, self.kv_caches, batch.meta, batch.logits_indices)


def _rows_and_changes(message: SchedulerOutput) -> tuple[tuple, list[int]]:
    """What each row of the step is (its requests, its searches and their slots) and the rows whose block tables the
    message changed: a decode batch of the same rows as the graph step before it only moves that step's inputs on."""
    searches, changes = message.searches, message.table_changes
    changed = [row for row, request_id in enumerate(message.request_ids) if request_id in changes]
    first = len(message.request_ids)
    for search_id, num_slots in zip(searches.search_ids, searches.num_slots):
        changed.extend(first + slot for slot, *_ in searches.table_changes.get(search_id, ()) if slot < num_slots)
        first += num_slots
    return (tuple(message.request_ids), tuple(searches.search_ids), tuple(searches.num_slots)), changed


def _cache_layers(specs: list[KVCacheSpec]) -> list[KVCacheSpec]:
    """The layers that own a KV tensor: the self-attention ones, all of one shape (one block table per request; a
    sliding-window layer keeps every token too, as a full one does: no block is freed early). An encoder-decoder's
    cross-attention layers (a second group, its own block table) share their decoder layer's tensor, so one pool of
    blocks serves both groups; they must match its shape."""
    own = [spec for spec in specs if spec.kind != "cross"]
    shapes = {(spec.num_kv_heads, spec.head_dim) for spec in own}
    cross = {(spec.num_kv_heads, spec.head_dim) for spec in specs if spec.kind == "cross"}
    if len(shapes) != 1 or any(spec.kind not in ("full", "sliding_window") for spec in own) or \
            (cross and cross != shapes):
        raise ValueError(f"the model's layers cache differently ({sorted({s.kind for s in specs})}): this engine "
                         "runs one self-attention KV cache group (and a cross-attention one of the same shape); "
                         "such a model is not supported yet")
    return own


def _allowed_tokens(rows: list[int], bitmask, num_rows: int, vocab: int, device: torch.device) -> torch.Tensor:
    """[num_rows, vocab] bool from the grammar rows' packed bitmask (bit t of word t // 32); other rows allow all."""
    words = torch.from_numpy(bitmask).to(device, non_blocking=True)
    bits = (words[:, :, None] >> torch.arange(32, device=device, dtype=torch.int32)) & 1
    allowed = torch.ones(num_rows, vocab, dtype=torch.bool, device=device)
    allowed[host_to_device(rows, torch.long, device)] = bits.view(len(rows), -1)[:, :vocab].bool()
    return allowed
