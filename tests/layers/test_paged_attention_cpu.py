"""The CPU (torch) paged attention's decode paths against attention over the plain K/V sequence: one sequence
reading its blocks in place (consecutive ids) or gathered (scattered ids), with and without a sliding window,
and a padded, masked batch of several sequences; and store_kv writing K and V to their slots."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fasterllm.kernels.native import cpu_attention, cpu_extension
from fasterllm.layers.attention import AttentionMetadata, paged_attention, store_kv

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 6, 2, 8, 4, 12
CPU = torch.device("cpu")


def cache_holding(sequences: list[torch.Tensor], tables: list[list[int]], head_dim: int = HEAD_DIM) -> torch.Tensor:
    """A random cache with each sequence's K/V ([2, L, Hkv, D]) written into its blocks, in table order."""
    cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, head_dim)
    for kv, table in zip(sequences, tables):
        for position in range(kv.shape[1]):
            cache[:, table[position // BLOCK_SIZE], position % BLOCK_SIZE] = kv[:, position]
    return cache


def reference(query: torch.Tensor, kv: torch.Tensor, window: int | None) -> torch.Tensor:
    """The last token's attention over the sequence's keys (its window's), K/V heads repeated: [Hq * D]."""
    keys = kv[:, -window:] if window is not None else kv
    k, v = (keys[i].transpose(0, 1).repeat_interleave(NUM_HEADS // NUM_KV_HEADS, dim=0) for i in (0, 1))
    out = F.scaled_dot_product_attention(query[:, None], k, v, scale=query.shape[-1] ** -0.5)
    return out.reshape(-1)


def decode(queries: torch.Tensor, seq_lens: list[int], tables: list[list[int]], cache: torch.Tensor,
           window: int | None) -> torch.Tensor:
    meta = AttentionMetadata.build([1] * len(seq_lens), seq_lens, tables, BLOCK_SIZE, CPU, window)
    unused = torch.empty(len(seq_lens), NUM_KV_HEADS, HEAD_DIM)  # the new K/V are read from the cache
    return paged_attention(queries, unused, unused, cache, meta, HEAD_DIM ** -0.5)


@pytest.mark.parametrize("table", [[3, 4, 5, 6], [9, 2, 7, 0]], ids=["consecutive", "scattered"])
@pytest.mark.parametrize("seq_len", [1, 4, 13])
@pytest.mark.parametrize("window", [None, 5])
def test_one_sequence_decode_matches_attention_over_its_keys(table, seq_len, window):
    torch.manual_seed(seq_len)
    kv = torch.randn(2, seq_len, NUM_KV_HEADS, HEAD_DIM)
    query = torch.randn(1, NUM_HEADS, HEAD_DIM)
    meta = AttentionMetadata.build([1], [seq_len], [table], BLOCK_SIZE, CPU, window)
    in_place = table[0] == 3 or seq_len <= BLOCK_SIZE  # one block is consecutive too
    assert isinstance(meta.decode.blocks, slice) == in_place  # the path named is the path tested
    got = decode(query, [seq_len], [table], cache_holding([kv], [table]), window)
    torch.testing.assert_close(got[0], reference(query[0], kv, window), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("window", [None, 5])
def test_decode_batch_matches_each_sequence_alone(window):
    torch.manual_seed(0)
    seq_lens, tables = [13, 2, 8], [[0, 1, 2, 3], [5], [7, 4]]
    sequences = [torch.randn(2, n, NUM_KV_HEADS, HEAD_DIM) for n in seq_lens]
    queries = torch.randn(len(seq_lens), NUM_HEADS, HEAD_DIM)
    got = decode(queries, seq_lens, tables, cache_holding(sequences, tables), window)
    for row, kv in enumerate(sequences):
        torch.testing.assert_close(got[row], reference(queries[row], kv, window), atol=1e-6, rtol=1e-6)


def test_store_kv_writes_keys_and_values_to_their_slots():
    torch.manual_seed(0)
    cache = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    # two tokens of a sequence whose table is [6, 1]: positions 3 (block 6) and 4 (block 1, offset 0)
    meta = AttentionMetadata.build([2], [5], [[6, 1]], BLOCK_SIZE, CPU)
    qkv = torch.randn(2, NUM_HEADS + 2 * NUM_KV_HEADS, HEAD_DIM)
    store_kv(cache, qkv[:, NUM_HEADS:], meta.slot_mapping)
    key, value = qkv[:, NUM_HEADS:NUM_HEADS + NUM_KV_HEADS], qkv[:, NUM_HEADS + NUM_KV_HEADS:]
    assert torch.equal(cache[0, 6, 3], key[0]) and torch.equal(cache[1, 6, 3], value[0])
    assert torch.equal(cache[0, 1, 0], key[1]) and torch.equal(cache[1, 1, 0], value[1])
    assert torch.count_nonzero(cache) == 2 * 2 * NUM_KV_HEADS * HEAD_DIM  # nothing else written


@pytest.mark.parametrize("native", [False, True], ids=["sdpa", "native"])
def test_cross_attention_rows_sharing_blocks_match_each_row_alone(native):
    """Cross-attention where runs of decode rows share one cross block table (a beam search's slots: runs of 3, 1 and
    2 here, the 1-run padded to the others' length) and a two-token chunk sits among them: every row attends to all
    of its table's encoder keys, as it would alone. Through SDPA over the runs (a head size the C++ attention does
    not take) and, where the C++ extension is built, through its attention over each row's own table and keys."""
    if native and not cpu_extension.available():
        pytest.skip("the C++ extension is not built here")
    head_dim = 64 if native else HEAD_DIM
    torch.manual_seed(0)
    tables = {"a": [3, 4], "b": [9], "c": [0, 7, 2], "d": [5]}
    encoder_lens = {"a": 6, "b": 3, "c": 10, "d": 4}
    rows = ["a", "a", "a", "b", "c", "d", "d"]
    query_lens = [1, 1, 1, 2, 1, 1, 1]
    encoded = {name: torch.randn(2, n, NUM_KV_HEADS, head_dim) for name, n in encoder_lens.items()}
    cache = cache_holding(list(encoded.values()), list(tables.values()), head_dim)
    meta = AttentionMetadata.build_cross(query_lens, [encoder_lens[r] for r in rows], [tables[r] for r in rows],
                                         BLOCK_SIZE, CPU)
    assert meta.decode.query_runs is not None and meta.decode.query_runs[2] == 3  # the path named is the path tested
    queries = torch.randn(sum(query_lens), NUM_HEADS, head_dim)
    assert cpu_attention.runs(queries, cache) == native
    got = paged_attention(queries, None, None, cache, meta, head_dim ** -0.5)
    token = 0
    for name, count in zip(rows, query_lens):
        for _ in range(count):
            torch.testing.assert_close(got[token], reference(queries[token], encoded[name], None), atol=1e-6,
                                       rtol=1e-6)
            token += 1
