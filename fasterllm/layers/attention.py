"""Paged attention: KV stored by slot mapping, read back through block tables.

On a GPU the Triton kernels do it (`attend_with_kernels`: RoPE fused with the KV store, then
attention: two launches). The torch path below is the one used on the CPU. The
per-step work that every layer shares (which cache slots each sequence reads, the masks) is done
once in `AttentionMetadata.build`; each layer then only gathers and calls SDPA.

Cache layout per layer: [2, num_blocks, block_size, num_kv_heads, head_dim] (key, value); a slot
is block_id * block_size + offset. Padding rows come last in a batch and are never stored.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from fasterllm.kernels.native import cpu_attention
from fasterllm.layers.kv_cache_dtype import FP8_KV_DTYPE, cache_values, read_back

if TYPE_CHECKING:
    from fasterllm.worker.piecewise_graphs import PiecewiseCapture


@dataclass
class PrefillGroup:
    """One sequence with several new tokens (a prompt or a chunk of one)."""

    token_start: int
    token_end: int
    context_blocks: torch.Tensor | None  # the sequence's blocks; None when nothing is cached before the chunk
    mask: torch.Tensor | None  # [q, kv] causal mask offset by the cached context


@dataclass
class DecodeGroup:
    """All sequences with exactly one new token, attended to in one padded call."""

    token_index: torch.Tensor | None  # rows of the flat batch; None when every row is a decode
    # [B * max_blocks] block ids, row by row (short rows padded with real blocks, masked), gathered; or, for one
    # sequence whose blocks are consecutive ids, their range, read in place
    blocks: torch.Tensor | slice
    mask: torch.Tensor | None  # [B, 1, 1, max_blocks * block_size] True where the key is real; None: one sequence
    keys: slice  # the key positions each row reads (one sequence: its window, so no mask is needed)
    positions: list[int]  # each row's query position
    # for the C++ attention (kernels/native/cpu_attention.py), which reads each row's own keys in place: [B, W] each
    # row's block ids (padded) and [B, 2] its keys (first, end: its window); None where a position bias rides on the
    # mask
    block_table: torch.Tensor | None = None
    key_ranges: torch.Tensor | None = None
    # cross-attention where runs of consecutive rows share one cross block table (a beam search's slots), each run
    # padded to g rows: (the row each of the [runs * g] query places reads, a run's rows then repeats of its first;
    # the place of each row's result; g). blocks, mask and keys are then the runs'
    query_runs: tuple[torch.Tensor, torch.Tensor, int] | None = None


@dataclass
class KernelInputs:
    """What the Triton kernels read (GPU): the batch's block tables and lengths as device tensors."""

    block_tables: torch.Tensor  # [S, max_blocks] int32
    seq_lens: torch.Tensor  # [S] int32: tokens in the cache once this step's are stored
    query_start_loc: torch.Tensor  # [S + 1] int32: sequence s owns new-token rows [start[s], start[s + 1])
    max_query_len: int
    position_bias: torch.Tensor | None = None  # T5: [distance rows, Hq] added to the scores (set by the model)


@dataclass
class AttentionMetadata:
    positions: torch.Tensor  # [T] each new token's position in its sequence
    slot_mapping: torch.Tensor  # [T] where each new token's K/V goes (-1: a padding row, stored nowhere)
    num_actual_tokens: int
    prefills: list[PrefillGroup]
    decode: DecodeGroup | None
    kernel: KernelInputs | None = None  # set on a GPU, where the Triton kernels replace the groups above
    pieces: PiecewiseCapture | None = None  # set while a piecewise CUDA graph is captured (worker/piecewise_graphs.py)
    # encoder-decoder models: the same rows' attention over the encoder's K/V (build_cross), for cross-attention
    cross: AttentionMetadata | None = None
    sliding_window: int | None = None  # the window the groups above were built for
    # build()'s inputs, and the metadata of other windows built from them (layers with windows of their own)
    build_inputs: tuple | None = None
    by_window: dict = field(default_factory=dict)

    @staticmethod
    def build(query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
              block_size: int, device: torch.device, sliding_window: int | None = None) -> "AttentionMetadata":
        """query_lens[i] new tokens for sequence i, which then holds seq_lens[i] tokens in all.

        With a sliding window, a query at position p sees keys p - window < k <= p.
        """
        inputs = (query_lens, seq_lens, block_tables, block_size, device)
        if max(query_lens) == 1:  # a decode batch: positions and slots in plain Python (fewer tensor ops a step)
            positions = [seq_len - 1 for seq_len in seq_lens]
            slots = [table[p // block_size] * block_size + p % block_size for table, p in zip(block_tables, positions)]
            decode = _decode_group(list(range(len(seq_lens))), query_lens, seq_lens, block_tables, block_size, device,
                                   sliding_window)
            return AttentionMetadata(torch.tensor(positions, device=device), torch.tensor(slots, device=device),
                                     len(seq_lens), [], decode, sliding_window=sliding_window, build_inputs=inputs)
        width = max(len(t) for t in block_tables)
        tables = torch.from_numpy(np.array([t + [0] * (width - len(t)) for t in block_tables], dtype=np.int64))
        seq_index = torch.repeat_interleave(torch.arange(len(query_lens)), torch.tensor(query_lens))
        positions = torch.cat([torch.arange(s - q, s) for q, s in zip(query_lens, seq_lens)])
        slot_mapping = tables[seq_index, positions // block_size] * block_size + positions % block_size
        prefills: list[PrefillGroup] = []
        decode_rows: list[int] = []
        start = 0
        for i, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens)):
            context_len = seq_len - query_len
            if query_len == 1:
                decode_rows.append(i)
            elif context_len == 0 and (sliding_window is None or query_len <= sliding_window):
                prefills.append(PrefillGroup(start, start + query_len, None, None))
            else:
                key_positions = torch.arange(seq_len, device=device)
                offset = key_positions[None, :] - key_positions[context_len:, None]  # key - query position
                mask = offset <= 0
                if sliding_window is not None:
                    mask &= offset > -sliding_window
                blocks = tables[i, :-(-seq_len // block_size)]
                prefills.append(PrefillGroup(start, start + query_len, blocks.to(device), mask))
            start += query_len
        decode = _decode_group(decode_rows, query_lens, seq_lens, block_tables, block_size, device,
                               sliding_window) if decode_rows else None
        return AttentionMetadata(positions.to(device), slot_mapping.to(device), start, prefills, decode,
                                 sliding_window=sliding_window, build_inputs=inputs)

    def for_window(self, sliding_window: int | None) -> AttentionMetadata:
        """The same step's metadata for a layer with another window (Gemma 2 alternates windowed and full layers):
        built once a step, on first use (torch path)."""
        if sliding_window == self.sliding_window:
            return self
        if sliding_window not in self.by_window:
            self.by_window[sliding_window] = AttentionMetadata.build(*self.build_inputs, sliding_window)
        return self.by_window[sliding_window]

    def add_position_bias(self, bias: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        """Make every group's mask additive: bias(query positions [q], key positions [k]) -> [H, q, k] where a key is
        visible, -inf where not (T5's relative-position bias; computed once a step, read by every layer)."""
        device = self.positions.device
        for group in self.prefills:
            num_queries = group.token_end - group.token_start
            if group.mask is None:  # the whole sequence is new: causal over itself
                keys = torch.arange(num_queries, device=device)
                visible = keys[None, :] <= keys[:, None]
            else:
                keys = torch.arange(group.mask.shape[1], device=device)
                visible = group.mask
            queries = keys[len(keys) - num_queries:]
            group.mask = bias(queries, keys).masked_fill(~visible, float("-inf"))[None]
        d = self.decode
        if d is not None:
            keys = torch.arange(d.keys.start, d.keys.stop, device=device)
            values = bias(torch.tensor(d.positions, device=device), keys).transpose(0, 1)[:, :, None, :]  # [B, H, 1, k]
            d.mask = values if d.mask is None else values.masked_fill(~d.mask, float("-inf"))
            d.block_table = d.key_ranges = None  # the bias rides on the mask: SDPA's path

    @staticmethod
    def build_cross(query_lens: list[int], encoder_lens: list[int], cross_tables: list[list[int]], block_size: int,
                    device: torch.device) -> AttentionMetadata:
        """Cross-attention: every new token of sequence i attends to all encoder_lens[i] keys of its cross blocks
        (stored once, when its encoder ran), not causally. Nothing is stored, so there are no slots."""
        prefills: list[PrefillGroup] = []
        decode_rows: list[int] = []
        start = 0
        for i, (query_len, encoder_len) in enumerate(zip(query_lens, encoder_lens)):
            if query_len == 1:
                decode_rows.append(i)
            else:
                blocks = torch.tensor(cross_tables[i][:-(-encoder_len // block_size)], device=device)
                mask = torch.ones(query_len, encoder_len, dtype=torch.bool, device=device)
                prefills.append(PrefillGroup(start, start + query_len, blocks, mask))
            start += query_len
        decode = _cross_decode_group(decode_rows, query_lens, encoder_lens, cross_tables, block_size,
                                     device) if decode_rows else None
        empty = torch.empty(0, dtype=torch.long, device=device)
        return AttentionMetadata(empty, empty, start, prefills, decode)


def _decode_group(rows: list[int], query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
                  block_size: int, device: torch.device, sliding_window: int | None) -> DecodeGroup:
    """The decode rows' blocks and key range: each row's own (the C++ attention's) and the gather SDPA reads."""
    lens = [seq_lens[row] for row in rows]
    starts = [0] * len(lens) if sliding_window is None else [max(0, n - sliding_window) for n in lens]
    table, key_ranges = _row_tables(rows, block_tables, -(-max(lens) // block_size), starts, lens)
    return DecodeGroup(_token_index(rows, query_lens, device), *_gathered_keys(table, starts, lens, block_size, device),
                       [n - 1 for n in lens], table, key_ranges)


def _token_index(rows: list[int], query_lens: list[int], device: torch.device) -> torch.Tensor | None:
    """The flat batch's row of each decode row's token; None when every row is a decode."""
    if len(rows) == len(query_lens):
        return None
    row_ends = list(itertools.accumulate(query_lens))
    return torch.tensor([row_ends[row] - 1 for row in rows], device=device)


def _row_tables(rows: list[int], block_tables: list[list[int]], num_blocks: int, starts: list[int],
                lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's block ids, short rows padded with block 0 (a real block whose keys the mask or the key range
    hides), [B, num_blocks]; and its keys (first, end), [B, 2]: what the C++ attention reads of each row."""
    # through numpy: torch.tensor over nested lists took ~1 ms for 256 rows of 13 blocks, np.array ~0.3 ms
    table = torch.from_numpy(np.array([(block_tables[row] + [0] * num_blocks)[:num_blocks] for row in rows],
                                      dtype=np.int64))
    return table, torch.tensor([starts, lens], dtype=torch.long).t().contiguous()


def _gathered_keys(table: torch.Tensor, starts: list[int], lens: list[int], block_size: int,
                   device: torch.device) -> tuple[torch.Tensor | slice, torch.Tensor | None, slice]:
    """What the SDPA path reads for rows with these tables and keys [starts, lens): (blocks, mask, keys). One
    sequence (single-stream decoding) needs no mask: its keys are cut to its own window, and its blocks, when
    consecutive (as a fresh pool hands them out), are read in place instead of gathered."""
    num_blocks = table.shape[1]
    if len(lens) == 1:
        ids, keys = table[0].tolist(), slice(starts[0], lens[0])
        if ids == list(range(ids[0], ids[0] + num_blocks)):
            return slice(ids[0], ids[0] + num_blocks), None, keys
        return table[0].to(device), None, keys
    key_positions = torch.arange(num_blocks * block_size)[None, :]
    mask = (key_positions < torch.tensor(lens)[:, None]) & (key_positions >= torch.tensor(starts)[:, None])
    return table.to(device).view(-1), mask[:, None, None, :].to(device), slice(0, num_blocks * block_size)


def _cross_decode_group(rows: list[int], query_lens: list[int], encoder_lens: list[int], cross_tables: list[list[int]],
                        block_size: int, device: torch.device) -> DecodeGroup:
    """The decode rows' cross-attention. Consecutive rows with one cross block table (the slots of a beam search,
    which share the request's cross blocks) read those blocks once, their queries as rows of one attention, padded
    to the longest run: the gather and the attention per block move a run's worth once, not once a slot. Each
    row's own table and keys stay for the C++ attention, which reads every row's keys in place."""
    runs = [0]  # the start of each run, as positions in rows
    for i in range(1, len(rows)):
        if cross_tables[rows[i]] != cross_tables[rows[i - 1]]:
            runs.append(i)
    if len(runs) == len(rows):
        return _decode_group(rows, query_lens, encoder_lens, cross_tables, block_size, device, None)
    lengths = [end - start for start, end in zip(runs, runs[1:] + [len(rows)])]
    longest = max(lengths)
    places, results = [], []
    for run, (start, length) in enumerate(zip(runs, lengths)):
        places.extend(list(range(start, start + length)) + [start] * (longest - length))
        results.extend(range(run * longest, run * longest + length))
    lens = [encoder_lens[row] for row in rows]
    num_blocks = -(-max(lens) // block_size)
    table, key_ranges = _row_tables(rows, cross_tables, num_blocks, [0] * len(lens), lens)
    run_lens = [lens[start] for start in runs]
    return DecodeGroup(_token_index(rows, query_lens, device),
                       *_gathered_keys(table[runs], [0] * len(runs), run_lens, block_size, device),
                       [n - 1 for n in lens], table, key_ranges,
                       (torch.tensor(places, device=device), torch.tensor(results, device=device), longest))


def attend_with_kernels(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, kv_cache: torch.Tensor,
                        meta: AttentionMetadata, cos_sin: torch.Tensor | None, scale: float,
                        sliding_window: int | None = None, softcap: float | None = None,
                        kv_scales: tuple[float, float] = (1.0, 1.0),
                        head_norms: tuple[torch.Tensor, torch.Tensor, float] | None = None) -> torch.Tensor:
    """GPU: qkv [T, Hq + 2 Hkv, D] -> attention output [T, Hq * D]; one launch applies RoPE to Q and K in
    place (cos_sin None: no rotary positions) and stores the new K/V by slot, then one launch attends every
    sequence (prefill, chunk or decode), within the layer's sliding window. kv_scales: (k_scale, v_scale) of an
    fp8 cache. head_norms: (q weight, k weight, eps) of per-head RMSNorms, in the rotary launch (needs cos_sin)."""
    from fasterllm.kernels.kv_store import store_kv as store_kv_kernel
    from fasterllm.kernels.paged_attention import (
        paged_attention as paged_attention_kernel,
    )
    from fasterllm.kernels.rotary import rotary_and_store_kv

    query, key, value = qkv.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    if cos_sin is None:
        store_kv_kernel(key, value, kv_cache[0], kv_cache[1], meta.slot_mapping, *kv_scales)
    else:
        rotary_and_store_kv(query, key, value, meta.positions, cos_sin, kv_cache[0], kv_cache[1], meta.slot_mapping,
                            *kv_scales, head_norms)

    def attend(k: KernelInputs, out: torch.Tensor | None = None) -> torch.Tensor:
        return paged_attention_kernel(query, kv_cache[0], kv_cache[1], k.block_tables, k.seq_lens, k.query_start_loc,
                                      k.max_query_len, scale, sliding_window, out=out, position_bias=k.position_bias,
                                      softcap=softcap, k_scale=kv_scales[0], v_scale=kv_scales[1])

    # while a piecewise CUDA graph is captured, attention is left out of it: the graph ends here and attend runs
    # between its pieces when they are replayed, on that step's sequences
    out = attend(meta.kernel) if meta.pieces is None else meta.pieces.split_at(attend, query)
    return out.view(qkv.shape[0], num_heads * qkv.shape[2])


def cross_attend_with_kernels(query: torch.Tensor, kv_cache: torch.Tensor, cross: KernelInputs,
                              scale: float, kv_scales: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:
    """GPU cross-attention: query [T, H, D] over each sequence's cross blocks, all its keys visible -> [T, H * D]."""
    from fasterllm.kernels.paged_attention import (
        paged_attention as paged_attention_kernel,
    )

    out = paged_attention_kernel(query, kv_cache[0], kv_cache[1], cross.block_tables, cross.seq_lens,
                                 cross.query_start_loc, cross.max_query_len, scale, causal=False,
                                 k_scale=kv_scales[0], v_scale=kv_scales[1])
    return out.view(query.shape[0], -1)


def store_kv(kv_cache: torch.Tensor, key_value: torch.Tensor, slot_mapping: torch.Tensor,
             kv_scales: tuple[float, float] = (1.0, 1.0)) -> None:
    """Write the tokens' K/V into their slots in one copy; key_value [T, 2 * Hkv, D] holds each token's
    key heads then its value heads (as the fused QKV projection lays them out); rows past the slots' count are
    padding. An fp8 cache gets K / k_scale and V / v_scale on the e4m3 grid, written as bytes (torch's CPU
    indexing has no fp8 kernels). On a GPU one Triton launch: for a layer's cross K/V of BART-large's 8,192 encoder
    tokens torch's index_copy_ took 27 us on an H200, the Triton store 17 us."""
    n = slot_mapping.shape[0]
    num_kv_heads, head_dim = key_value.shape[1] // 2, key_value.shape[2]
    if key_value.is_cuda:
        from fasterllm.kernels.kv_store import store_kv as store_kv_kernel

        store_kv_kernel(key_value[:n, :num_kv_heads], key_value[:n, num_kv_heads:], kv_cache[0], kv_cache[1],
                        slot_mapping, *kv_scales)
        return
    rows = key_value[:n].view(n, 2, num_kv_heads, head_dim).transpose(0, 1)
    if kv_cache.dtype == FP8_KV_DTYPE:
        rows = torch.stack([cache_values(rows[i], kv_scales[i], FP8_KV_DTYPE) for i in (0, 1)]).view(torch.uint8)
        kv_cache = kv_cache.view(torch.uint8)
    kv_cache.view(2, -1, num_kv_heads, head_dim).index_copy_(1, slot_mapping, rows)


def _read_blocks(kv_cache: torch.Tensor, blocks: torch.Tensor | slice, dtype: torch.dtype,
                 kv_scales: tuple[float, float]) -> torch.Tensor:
    """K and V of the blocks [2, n, block_size, Hkv, D] (a view for a slice of blocks, else gathered); an fp8
    cache's read as bytes, then widened to dtype and scaled."""
    fp8 = kv_cache.dtype == FP8_KV_DTYPE
    raw = kv_cache.view(torch.uint8) if fp8 else kv_cache
    raw = raw[:, blocks] if isinstance(blocks, slice) else raw.index_select(1, blocks)
    if not fp8:
        return raw
    values = raw.view(FP8_KV_DTYPE).to(dtype)
    values[0] *= kv_scales[0]
    values[1] *= kv_scales[1]
    return values


def paged_attention(query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None,
                    kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                    softcap: float | None = None, kv_scales: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:
    """query [T, Hq, D], key/value [T, Hkv, D] of the new tokens -> [T, Hq * D].

    The new K/V must already be stored (store_kv); cached context is read back whole blocks at a
    time (a block is one contiguous run of memory, far cheaper to gather than single slots). key/value are read
    only for a sequence with nothing cached before its new tokens; cross-attention (every key cached) passes None.
    softcap: scores become softcap * tanh(scores / softcap) before the mask (Gemma 2). kv_scales: (k_scale, v_scale)
    of an fp8 cache. The decode rows attend in one C++ call (kernels/native/cpu_attention.py) where it runs.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[-2] if key is None else key.shape[1]
    if key is not None and kv_cache is not None:  # what the cache holds: an fp8 cache's values, as every read sees
        key, value = (read_back(x, s, kv_cache.dtype) for x, s in ((key, kv_scales[0]), (value, kv_scales[1])))
    decode = meta.decode
    if decode is not None and decode.token_index is None:  # a pure decode batch: no scatter needed
        return _decode_attention(query, kv_cache, decode, scale, softcap, kv_scales).reshape(
            num_tokens, num_heads * head_dim)
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=query.dtype, device=query.device)
    for group in meta.prefills:
        # SDPA's GQA support wants [batch, heads, tokens, D]: 3-D inputs give wrong results on CUDA
        q = query[group.token_start:group.token_end].transpose(0, 1)[None]
        if group.context_blocks is None:  # the whole sequence is new: attend to it directly
            k = key[group.token_start:group.token_end].transpose(0, 1)[None]
            v = value[group.token_start:group.token_end].transpose(0, 1)[None]
            o = _attend(q, k, v, group.mask, scale, softcap, is_causal=group.mask is None)
        else:
            seq_len = group.mask.shape[-1]
            k, v = _read_blocks(kv_cache, group.context_blocks, query.dtype, kv_scales).view(
                2, -1, num_kv_heads, head_dim)[:, :seq_len].transpose(1, 2)[:, None]
            o = _attend(q, k, v, group.mask, scale, softcap)
        out[group.token_start:group.token_end] = o[0].transpose(0, 1)
    if decode is not None:
        out[decode.token_index] = _decode_attention(query[decode.token_index], kv_cache, decode, scale, softcap,
                                                    kv_scales)
    return out.view(num_tokens, num_heads * head_dim)


def _decode_attention(query: torch.Tensor, kv_cache: torch.Tensor, d: DecodeGroup, scale: float,
                      softcap: float | None, kv_scales: tuple[float, float]) -> torch.Tensor:
    """One new token per sequence: [B, Hq, D] -> [B, Hq, D]: each row over its own keys in one C++ call where it runs
    (bf16 and fp32, a head size it takes), else all sequences in one padded SDPA batch."""
    if d.key_ranges is not None and softcap is None and cpu_attention.runs(query, kv_cache):
        return cpu_attention.decode_attention(query, kv_cache, d.block_table, d.key_ranges, scale)
    batch, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[-2]
    group = num_heads // num_kv_heads
    rows_each = 1 if d.query_runs is None else d.query_runs[2]
    if d.query_runs is not None:  # a run's rows, [runs, g, H, D], become query rows: [runs, Hkv, g * group, D]
        query = query.index_select(0, d.query_runs[0])
        batch = query.shape[0] // rows_each
    # each KV head's query heads become rows of one query block: no K/V repeat needed
    q = query.view(batch, rows_each, num_kv_heads, group, head_dim).transpose(1, 2).reshape(
        batch, num_kv_heads, rows_each * group, head_dim)
    kv = _read_blocks(kv_cache, d.blocks, query.dtype, kv_scales)  # K and V together: a view, or one gather
    kv = kv.view(2, batch, -1, num_kv_heads, head_dim)[:, :, d.keys].transpose(2, 3)
    mask = d.mask
    if mask is not None and mask.shape[1] == num_heads:  # an additive mask per query head: rows of its KV head
        mask = mask.view(mask.shape[0], num_kv_heads, group, -1)
    out = _attend(q, kv[0], kv[1], mask, scale, softcap)
    if d.query_runs is None:
        return out.reshape(batch, num_heads, head_dim)
    out = out.view(batch, num_kv_heads, rows_each, group, head_dim).transpose(1, 2)
    return out.reshape(batch * rows_each, num_heads, head_dim).index_select(0, d.query_runs[1])


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
            softcap: float | None, is_causal: bool = False) -> torch.Tensor:
    """SDPA over [B, H, q, D] queries and [B, Hkv, k, D] keys/values (Hkv dividing H); mask: bool (True: visible)
    or additive. With softcap the scores are capped before the mask, which SDPA cannot do: the product is written
    out, in fp32."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                              enable_gqa=True)
    if k.shape[1] != q.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)).mul_(scale / softcap).tanh_().mul_(softcap)
    if is_causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril_()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    return torch.matmul(scores.softmax(dim=-1).to(v.dtype), v)
