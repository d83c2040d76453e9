"""Paged attention over block tables (Triton): prefill, chunked prefill and decode in one launch.

One program per (sequence, query tile, KV head); in launches with prompt rows the query tiles of all sequences are
packed along the grid's first axis, so a decode beside a long prompt gets one program, not the prompt's count. A
tile's rows are (new token, query head) pairs: all G = Hq / Hkv query heads of the KV head for BLOCK_Q consecutive
new tokens, so each K/V tile is read once for the whole GQA group. Keys are streamed through the block table with an
online softmax (exp2 of log2(e)-scaled scores), bounded by the causal limit and the sliding window; in launches with
prompt rows and no window the tiles every row sees whole skip the masks, and only the tiles at the causal edge are
masked. The grid depends on host ints only (numbers of sequences and tokens, max_query_len, KV heads), so a batch
can be captured in a CUDA graph.

Decode batches (max_query_len == 1) split each sequence's keys over several programs (flash-decoding:
short batches with long contexts would otherwise use a few SMs) and a second kernel merges the partial
results by their log-sum-exp. The split count comes from host ints (batch size, heads, block table width).

An fp8 cache (float8_e4m3fn, kernels/kv_store.py) is read as is and widened in registers (in decode launches under
bf16 queries to fp16: one instruction per pair, where bf16 takes more): K's scale is folded into the score scale and
V's multiplies the output, so a step reads half the bytes of a bf16 cache.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from fasterllm.kernels.dependent_launch import early_launch, early_start
from fasterllm.kernels.online_softmax import LOG2E, dot, online_softmax_update
from fasterllm.layers.kv_cache_dtype import FP8_KV_DTYPE

# decode programs wanted in flight (about four per SM on an H100) and the most splits of one sequence's keys: one
# sequence of 8,192 keys in 32 splits took 23.8 us against 30.2 in 16, of 32,000 keys in 64 splits 60.4 against 79.8 us
# (RESULTS.md: CUDA-graph replays on an H100); 4 sequences of 8 KV heads get 16 (61.7 us against 64.9 in 8), 64 and
# more one
_SM_TARGET = 512
_MAX_SPLITS = 64
_MIN_KEYS_PER_SPLIT = 256
# decode: two K/V tiles in flight instead of Triton's three leave shared memory for more programs per SM; 12-14%
# faster on an H100 at 64 sequences x 640-2048 keys, the same arithmetic (benchmarks/RESULTS.md). Decode launches keep
# one masked key loop: a second, unmasked loop costs its own pipeline start (64 x 640 keys 72 -> 82 us on an H100)
_DECODE_STAGES = 2


class PrefillTiles(NamedTuple):
    """The tiles of a launch with prompt rows (max_query_len > 1)."""
    rows: int  # the most (token, query head) rows a program holds (a power of two)
    keys: int  # keys per K/V tile (a power of two)
    num_warps: int
    num_stages: int


# the fastest or within 2% of it for prompts of 512-2048 tokens alone and beside 64-255 decodes, of nine tiles timed
# on an H100 (benchmarks/attention_gpu.py --prefill-tiles, RESULTS.md); 128 rows and 8 warps lose beside decodes
PREFILL_TILES = PrefillTiles(rows=64, keys=64, num_warps=4, num_stages=3)


@triton.jit
def _fold_key_tile(q, k_cache_ptr, v_cache_ptr, table, tile_start, key_end, kv_head, position, head, row_ok, dims,
                   dim_ok, row_max, row_sum, acc, bias_ptr, bias_rows, bias_row_stride, scale_log2, window, softcap,
                   stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, BLOCK_N: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr, USE_WINDOW: tl.constexpr, CAUSAL: tl.constexpr,
                   HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, IEEE_DOT: tl.constexpr,
                   FP16_DOT: tl.constexpr):
    """Fold the BLOCK_N keys from tile_start, read through the block table, into the rows' online softmax. MASKED:
    the tile may hold keys past key_end, after a row's position or outside its window; else every row sees all."""
    keys = tile_start + tl.arange(0, BLOCK_N)
    key_ok = keys < key_end
    if MASKED:
        block = tl.load(table + keys // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
    else:
        block = tl.load(table + keys // BLOCK_SIZE).to(tl.int64)
    offset = keys % BLOCK_SIZE
    k_at = k_cache_ptr + block[:, None] * stride_kb + offset[:, None] * stride_ks + kv_head * stride_kh + dims[None, :]
    v_at = v_cache_ptr + block[:, None] * stride_vb + offset[:, None] * stride_vs + kv_head * stride_vh + dims[None, :]
    kv_mask = key_ok[:, None] & dim_ok[None, :] if MASKED else dim_ok[None, :]
    k = tl.load(k_at, mask=kv_mask, other=0.0)
    v = tl.load(v_at, mask=kv_mask, other=0.0)
    if FP16_DOT:  # e4m3 widens to fp16 in one instruction per pair (to bf16 it takes more), and holds exactly
        k, v = k.to(tl.float16), v.to(tl.float16)
    else:  # the cache's values in the query's dtype (an fp8 cache's widened; its scales are applied apart)
        k, v = k.to(q.dtype), v.to(q.dtype)
    scores = dot(q, tl.trans(k), IEEE_DOT) * scale_log2
    if HAS_SOFTCAP:  # Gemma 2: softcap * tanh(score / softcap), on the natural-log score (tanh written out)
        capped = 2.0 / (1.0 + tl.exp(scores * (-2.0 / (softcap * 1.4426950408889634)))) - 1.0
        scores = capped * (softcap * 1.4426950408889634)
    if HAS_BIAS:  # T5: a learned bias per query head and distance back, from a [rows, Hq] table
        distance = tl.minimum(tl.maximum(position[:, None] - keys[None, :], 0), bias_rows - 1)
        bias = tl.load(bias_ptr + distance * bias_row_stride + head[:, None], mask=row_ok[:, None], other=0.0)
        scores += bias.to(tl.float32) * 1.4426950408889634  # log2(e): the scores are in log2 units
    if MASKED:
        visible = key_ok[None, :] & ((keys[None, :] <= position[:, None]) | (not CAUSAL))
        if USE_WINDOW:
            visible &= keys[None, :] > position[:, None] - window
        scores = tl.where(visible, scores, float("-inf"))
    return online_softmax_update(scores, v, row_max, row_sum, acc, IEEE_DOT)


@triton.jit
def _packed_tile(query_start_ptr, num_seqs, BLOCK_Q: tl.constexpr):
    """(sequence, query tile) of this program in a launch with prompt rows. Sequence s's tiles are the programs from
    query_start[s] // BLOCK_Q + s on, cdiv(its query length, BLOCK_Q) of them, which never reach the next sequence's
    first: so the grid needs only num_tokens // BLOCK_Q + num_seqs programs (host ints), where a grid of every
    sequence times the longest query's tiles gives each decode beside a long prompt as many idle programs. The
    sequence is the last whose first program is at or before this one (a binary search); a program past its
    sequence's tiles finds none and does nothing."""
    program = tl.program_id(0)
    low, high = 0, num_seqs - 1
    while low < high:
        middle = (low + high + 1) // 2
        at_or_before = tl.load(query_start_ptr + middle) // BLOCK_Q + middle <= program
        low = tl.where(at_or_before, middle, low)
        high = tl.where(at_or_before, high, middle - 1)
    return low, program - (tl.load(query_start_ptr + low) // BLOCK_Q + low)


@triton.jit
def _paged_attention_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr, out_ptr,
        part_out_ptr, part_max_ptr, part_sum_ptr, bias_ptr, bias_rows, scale_log2, v_scale, window, softcap,
        stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
        stride_bt, stride_ot, stride_oh,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr,
        USE_WINDOW: tl.constexpr, CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
        num_seqs, IEEE_DOT: tl.constexpr, FP16_DOT: tl.constexpr, PROMPT_ROWS: tl.constexpr,
        PDL: tl.constexpr):
    early_start(PDL)
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP_PAD
    if PROMPT_ROWS:  # the grid's axis 0 runs over every sequence's query tiles, packed (see _packed_tile)
        seq, tile = _packed_tile(query_start_ptr, num_seqs, BLOCK_Q)
    else:
        seq, tile = tl.program_id(0), tl.program_id(1)
    kv_head = tl.program_id(2)
    query_start = tl.load(query_start_ptr + seq)
    query_len = tl.load(query_start_ptr + seq + 1) - query_start
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len
    if NUM_SPLITS > 1:  # the programs of one (sequence, KV head) share its single query token
        split = tile
        first_token = 0
    else:
        split = 0
        first_token = tile * BLOCK_Q
    if first_token < query_len:
        rows = tl.arange(0, BLOCK_M)
        token = first_token + rows // GROUP_PAD
        head = kv_head * GROUP + rows % GROUP_PAD
        row_ok = (token < query_len) & (rows % GROUP_PAD < GROUP)
        dims = tl.arange(0, BLOCK_D)
        dim_ok = dims < HEAD_DIM
        q = tl.load(q_ptr + (query_start + token)[:, None].to(tl.int64) * stride_qt + head[:, None] * stride_qh
                    + dims[None, :], mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
        if FP16_DOT:
            q = q.to(tl.float16)
        position = context_len + token  # absolute position of each row's token
        if CAUSAL:
            key_end = tl.minimum(seq_len, context_len + tl.minimum(first_token + BLOCK_Q, query_len))
        else:  # cross-attention: every new token sees all seq_len keys (the encoder's)
            key_end = seq_len
        key_start = 0
        if USE_WINDOW:
            key_start = tl.maximum(0, context_len + first_token - window + 1)
        if NUM_SPLITS > 1:
            per_split = tl.cdiv(tl.cdiv(key_end - key_start, NUM_SPLITS), BLOCK_N) * BLOCK_N
            key_start = key_start + split * per_split
            key_end = tl.minimum(key_end, key_start + per_split)
        row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        table = block_tables_ptr + seq.to(tl.int64) * stride_bt
        bias_row_stride = tl.num_programs(2) * GROUP  # the bias table's row: one per query head
        # launches with prompt rows: the keys every row sees (at or before the first row's own position; inside
        # key_end, so the bounds need no clamp) skip the masks, whole tiles of them first, and only the tiles after
        # them (the causal edge) are masked. Under a sliding window, and in decode launches, every tile is masked
        full_end = key_start
        if PROMPT_ROWS and not USE_WINDOW:
            limit = context_len + first_token + 1 if CAUSAL else key_end
            full_end = key_start + (limit - key_start) // BLOCK_N * BLOCK_N
            for tile_start in range(key_start, full_end, BLOCK_N):
                row_max, row_sum, acc = _fold_key_tile(
                    q, k_cache_ptr, v_cache_ptr, table, tile_start, key_end, kv_head, position, head, row_ok, dims,
                    dim_ok, row_max, row_sum, acc, bias_ptr, bias_rows, bias_row_stride, scale_log2, window, softcap,
                    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, BLOCK_N, BLOCK_SIZE, False,
                    USE_WINDOW, CAUSAL, HAS_BIAS, HAS_SOFTCAP, IEEE_DOT, FP16_DOT)
        for tile_start in range(full_end, key_end, BLOCK_N):
            row_max, row_sum, acc = _fold_key_tile(
                q, k_cache_ptr, v_cache_ptr, table, tile_start, key_end, kv_head, position, head, row_ok, dims,
                dim_ok, row_max, row_sum, acc, bias_ptr, bias_rows, bias_row_stride, scale_log2, window, softcap,
                stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, BLOCK_N, BLOCK_SIZE, True,
                USE_WINDOW, CAUSAL, HAS_BIAS, HAS_SOFTCAP, IEEE_DOT, FP16_DOT)
        acc = acc * v_scale
        if NUM_SPLITS > 1:  # unnormalised partials, merged by _merge_splits_kernel
            part = (query_start + token).to(tl.int64) * (tl.num_programs(2) * GROUP) + head  # [token row, head]
            tl.store(part_max_ptr + part * NUM_SPLITS + split, row_max, mask=row_ok)
            tl.store(part_sum_ptr + part * NUM_SPLITS + split, row_sum, mask=row_ok)
            tl.store(part_out_ptr + (part * NUM_SPLITS + split)[:, None] * HEAD_DIM + dims[None, :], acc,
                     mask=row_ok[:, None] & dim_ok[None, :])
        else:
            out = acc / tl.where(row_sum > 0, row_sum, 1.0)[:, None]  # no visible key (seq_len 0): zeros
            tl.store(out_ptr + (query_start + token)[:, None].to(tl.int64) * stride_ot + head[:, None] * stride_oh
                     + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


@triton.jit
def _merge_splits_kernel(part_out_ptr, part_max_ptr, part_sum_ptr, query_start_ptr, out_ptr, stride_ot, stride_oh,
                         NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    early_start(PDL)
    seq, head = tl.program_id(0), tl.program_id(1)
    token = tl.load(query_start_ptr + seq)
    if tl.load(query_start_ptr + seq + 1) > token:  # padding sequences own no row
        splits = tl.arange(0, SPLITS_PAD)
        split_ok = splits < NUM_SPLITS
        dims = tl.arange(0, BLOCK_D)
        part = (token.to(tl.int64) * tl.num_programs(1) + head) * NUM_SPLITS + splits
        maxes = tl.load(part_max_ptr + part, mask=split_ok, other=float("-inf"))
        sums = tl.load(part_sum_ptr + part, mask=split_ok, other=0.0)
        outs = tl.load(part_out_ptr + part[:, None] * HEAD_DIM + dims[None, :],
                       mask=split_ok[:, None] & (dims[None, :] < HEAD_DIM), other=0.0)
        top = tl.max(maxes, axis=0)
        weights = tl.math.exp2(maxes - tl.where(top == float("-inf"), 0.0, top))  # empty splits weigh 0
        total = tl.sum(weights * sums, axis=0)
        out = tl.sum(weights[:, None] * outs, axis=0) / tl.where(total > 0, total, 1.0)
        tl.store(out_ptr + token.to(tl.int64) * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty),
                 mask=dims < HEAD_DIM)


def decode_splits(num_seqs: int, num_kv_heads: int, max_keys: int) -> int:
    """How many programs share one sequence's keys in a decode batch: enough to fill the GPU, each with
    at least _MIN_KEYS_PER_SPLIT keys of the longest possible sequence (host ints only: graph-safe)."""
    wanted = triton.cdiv(_SM_TARGET, max(1, num_seqs * num_kv_heads))
    return max(1, min(_MAX_SPLITS, wanted, max_keys // _MIN_KEYS_PER_SPLIT))


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                    max_query_len: int, scale: float, sliding_window: int | None = None,
                    out: torch.Tensor | None = None, num_kv_splits: int | None = None,
                    causal: bool = True, position_bias: torch.Tensor | None = None,
                    softcap: float | None = None, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """Causal attention of the new tokens' queries [T, Hq, D] to their sequences' cached keys/values.

    key_cache/value_cache [num_blocks, block_size, Hkv, D]; block_tables [S, max_blocks] int32;
    seq_lens [S] int32 (cached tokens including this step's, already stored); query_start_loc [S + 1]
    int32, from 0 (the rows of sequence s: query_start_loc[s] up to [s + 1]). num_kv_splits overrides the decode
    split count (tests; None picks one from the shapes).
    causal=False: cross-attention, every query of a sequence sees all its seq_lens keys (the encoder's).
    position_bias [R, Hq]: added to the score of a query and a key d positions back (d >= R - 1: row R - 1), T5's
    relative-position bias of a causal stack, tabulated by the model. softcap: each score becomes
    softcap * tanh(score / softcap) before the mask (Gemma 2). Caches in FP8_KV_DTYPE hold K / k_scale and
    V / v_scale (the scales are unused for caches in the query's dtype).
    """
    num_tokens, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, cache_dim = key_cache.shape
    num_seqs = seq_lens.shape[0]
    if value_cache.shape != key_cache.shape or cache_dim != head_dim:
        raise ValueError(f"key_cache {tuple(key_cache.shape)} and value_cache {tuple(value_cache.shape)} must both "
                         f"be [num_blocks, block_size, Hkv, D={head_dim}] (query is {tuple(query.shape)})")
    if num_heads % num_kv_heads:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of the cache's KV heads ({num_kv_heads})")
    if block_size & (block_size - 1) or any(t.stride(-1) != 1 for t in (query, key_cache, value_cache)):
        raise ValueError(f"block_size ({block_size}) must be a power of two and the head dim contiguous")
    if query_start_loc.shape != (num_seqs + 1,) or block_tables.shape[0] != num_seqs:
        raise ValueError(f"query_start_loc {tuple(query_start_loc.shape)} must be [S + 1] and block_tables "
                         f"{tuple(block_tables.shape)} [S, max_blocks] for S = {num_seqs} sequences")
    if key_cache.dtype != value_cache.dtype or key_cache.dtype not in (query.dtype, FP8_KV_DTYPE):
        raise ValueError(f"query ({query.dtype}) and the caches ({key_cache.dtype}, {value_cache.dtype}) "
                         f"must share a dtype, or the caches be {FP8_KV_DTYPE}")
    if sliding_window is not None and (sliding_window < 1 or not causal):
        raise ValueError(f"sliding_window must be >= 1 or None (and None for non-causal attention), got "
                         f"{sliding_window}")
    if position_bias is not None and (position_bias.dim() != 2 or position_bias.shape[1] != num_heads
                                      or not position_bias.is_contiguous() or not causal):
        raise ValueError(f"position_bias must be a contiguous [rows, Hq={num_heads}] table of a causal attention, got "
                         f"{tuple(position_bias.shape)}")
    if out is None:
        out = torch.empty_like(query)
    elif out.shape != query.shape or out.dtype != query.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(query.shape)} {query.dtype}, got {tuple(out.shape)} {out.dtype}")
    if num_seqs == 0 or max_query_len < 1:
        return out
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    # decode launches with bf16 queries over an fp8 cache multiply in fp16 (e4m3 is exact there; the queries' range is
    # far inside it) and take 128 keys a tile, the bytes of a bf16 cache's 64
    fp16_dot = key_cache.dtype == FP8_KV_DTYPE and query.dtype == torch.bfloat16 and max_query_len == 1
    block_d = max(16, triton.next_power_of_2(head_dim))
    if max_query_len == 1:
        splits = num_kv_splits or decode_splits(num_seqs, num_kv_heads, block_tables.shape[1] * block_size)
        block_m, block_n = max(16, group_pad), 128 if fp16_dot else 64
        grid = (num_seqs, splits, num_kv_heads)
    else:
        splits = 1
        block_m = max(16, min(PREFILL_TILES.rows, triton.next_power_of_2(max_query_len) * group_pad), group_pad)
        block_n = PREFILL_TILES.keys
        grid = (num_tokens // (block_m // group_pad) + num_seqs, 1, num_kv_heads)  # tiles packed: _packed_tile
    part_out = part_max = part_sum = out  # unused placeholders without splits
    if splits > 1:
        part_max = torch.empty(num_tokens, num_heads, splits, dtype=torch.float32, device=query.device)
        part_sum = torch.empty_like(part_max)
        part_out = torch.empty(num_tokens, num_heads, splits, head_dim, dtype=torch.float32, device=query.device)
    _paged_attention_kernel[grid](
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, out,
        part_out, part_max, part_sum, out if position_bias is None else position_bias,
        0 if position_bias is None else position_bias.shape[0], scale * LOG2E * k_scale, v_scale, sliding_window or 0,
        softcap or 0.0,
        query.stride(0), query.stride(1), *key_cache.stride()[:3], *value_cache.stride()[:3],
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=block_m,
        BLOCK_N=max(block_size, block_n), BLOCK_SIZE=block_size, NUM_SPLITS=splits,
        USE_WINDOW=sliding_window is not None, CAUSAL=causal, HAS_BIAS=position_bias is not None,
        HAS_SOFTCAP=softcap is not None, IEEE_DOT=query.dtype == torch.float32, FP16_DOT=fp16_dot,
        num_seqs=num_seqs, PROMPT_ROWS=max_query_len > 1,
        num_warps=4 if max_query_len == 1 else PREFILL_TILES.num_warps,
        num_stages=_DECODE_STAGES if max_query_len == 1 else PREFILL_TILES.num_stages, **early_launch(query.device))
    if splits > 1:
        _merge_splits_kernel[(num_seqs, num_heads)](
            part_out, part_max, part_sum, query_start_loc, out, out.stride(0), out.stride(1),
            NUM_SPLITS=splits, SPLITS_PAD=triton.next_power_of_2(splits), HEAD_DIM=head_dim, BLOCK_D=block_d,
            **early_launch(query.device))
    return out


def paged_attention_reference(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                              block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                              max_query_len: int, scale: float, sliding_window: int | None = None,
                              out: torch.Tensor | None = None, causal: bool = True,
                              position_bias: torch.Tensor | None = None, softcap: float | None = None,
                              k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """The same attention in plain torch, one sequence at a time, softmax in fp32 (an fp8 cache dequantized)."""
    out = torch.zeros_like(query) if out is None else out
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = query.shape[1] // num_kv_heads
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for seq, seq_len in enumerate(lens):
        start, end = starts[seq], starts[seq + 1]
        if end == start:
            continue
        blocks = block_tables[seq, :math.ceil(seq_len / block_size)].long()
        k, v = ((cache.view(torch.uint8)[blocks].view(cache.dtype).float() * scale)
                .reshape(-1, num_kv_heads, cache.shape[-1])[:seq_len].repeat_interleave(group, dim=1).transpose(0, 1)
                for cache, scale in ((key_cache, k_scale), (value_cache, v_scale)))
        q = query[start:end].float().transpose(0, 1)  # [Hq, q, D]
        positions = torch.arange(seq_len - (end - start), seq_len, device=query.device)[:, None]
        keys = torch.arange(seq_len, device=query.device)[None, :]
        visible = (keys <= positions) | (not causal)
        if sliding_window is not None:
            visible &= keys > positions - sliding_window
        scores = q @ k.transpose(1, 2) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        if position_bias is not None:
            distance = (positions - keys).clamp(0, position_bias.shape[0] - 1)
            scores = scores + position_bias.float()[distance].permute(2, 0, 1)
        scores = scores.masked_fill(~visible, float("-inf"))
        out[start:end] = (scores.softmax(-1) @ v).transpose(0, 1).to(out.dtype)
    return out
