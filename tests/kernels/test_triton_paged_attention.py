"""The Triton paged attention against its torch reference (and that against the model's attention path):
in Triton's interpreter on a CPU (tests/conftest.py sets TRITON_INTERPRET=1 there), natively on a GPU."""
from __future__ import annotations

import pytest
import torch

from fasterllm.layers import attention as layers_attention

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytest.importorskip("triton")
from fasterllm.kernels import paged_attention as paged_attention_module  # noqa: E402
from fasterllm.kernels.paged_attention import decode_splits, paged_attention, paged_attention_reference  # noqa: E402

gpu_only = pytest.mark.skipif(DEVICE.type != "cuda", reason="real model shapes need a GPU")
# Triton 3.9's interpreter computes tl.dot on bf16 wrongly (even for a lone 16x16 dot); bf16 runs on a GPU
HALF_DTYPES = [torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def make_batch(context_lens, query_lens, num_heads, num_kv_heads, head_dim, dtype, block_size=16, seed=0,
               padding_rows=0):
    """A random cache (every block filled, so reading a wrong block shows) and block tables that scatter each
    sequence over shuffled blocks. Returns the kernel's arguments; padding_rows adds unowned query rows."""
    generator = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    blocks_needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_needed) + 3
    order = torch.randperm(num_blocks, generator=generator).tolist()
    width = max(blocks_needed + [1]) + 1  # one spare column: rows are padded, as the runner pads them
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    for i, n in enumerate(blocks_needed):
        tables[i, :n] = torch.tensor([order.pop() for _ in range(n)], dtype=torch.int32)
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=generator).to(dtype)
    num_tokens = sum(query_lens) + padding_rows
    query = torch.randn(num_tokens, num_heads, head_dim, generator=generator).to(dtype)
    starts = torch.tensor([0] + query_lens).cumsum(0).to(torch.int32)
    return dict(query=query.to(DEVICE), key_cache=cache[0].to(DEVICE), value_cache=cache[1].to(DEVICE),
                block_tables=tables.to(DEVICE), seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
                query_start_loc=starts.to(DEVICE), max_query_len=max(query_lens + [0]), scale=head_dim ** -0.5)


def check(args, dtype, **kwargs):
    got = paged_attention(**args, **kwargs)
    kwargs.pop("num_kv_splits", None)
    expected = paged_attention_reference(**{name: (t.float() if name in ("query", "key_cache", "value_cache") else t)
                                            for name, t in args.items()}, **kwargs)
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), expected, atol=tolerance, rtol=tolerance)


# (context lengths, query lengths): a prompt, a chunk over a cached prefix, decodes (one past a block edge)
MIXED = ([0, 19, 40, 5], [20, 7, 1, 1])


@pytest.mark.parametrize("dtype", [torch.float32] + HALF_DTYPES)
def test_mixed_batch_matches_reference(dtype):
    check(make_batch(*MIXED, 4, 2, 64, dtype), dtype)


@pytest.mark.parametrize("window", [1, 8, 30])
def test_sliding_window(window):
    check(make_batch(*MIXED, 4, 2, 64, torch.float32), torch.float32, sliding_window=window)


@pytest.mark.parametrize("splits", [None, 1, 3])
@pytest.mark.parametrize("window", [None, 24])
def test_decode_split_kv(splits, window):
    """Decode batches split the keys over programs and merge them; a split may hold no key at all."""
    args = make_batch([0, 150, 33], [1, 1, 1], 4, 2, 64, torch.float32, block_size=32)
    check(args, torch.float32, sliding_window=window, num_kv_splits=splits)


def test_long_decode_splits_by_default():
    """One sequence with a long context: the default split count spreads it over several programs."""
    args = make_batch([700], [1], 4, 2, 64, torch.float32)
    assert decode_splits(1, 2, args["block_tables"].shape[1] * 16) > 1
    check(args, torch.float32)


@pytest.mark.parametrize("query_lens", [[1, 1, 0, 0], [3, 1, 0, 0]])
def test_padded_graph_rows_write_nothing(query_lens):
    """A captured batch padded with empty sequences (seq_len 0, no rows) leaves the padding rows as they were."""
    args = make_batch([17, 2, 0, 0], query_lens, 4, 2, 64, torch.float32, padding_rows=2)
    out = torch.full_like(args["query"], 7.0)
    paged_attention(**args, out=out, num_kv_splits=2 if max(query_lens) == 1 else None)
    real = sum(query_lens)
    expected = paged_attention_reference(**args)
    torch.testing.assert_close(out[:real], expected[:real], atol=1e-4, rtol=1e-4)
    assert torch.equal(out[real:], torch.full_like(out[real:], 7.0))


@pytest.mark.parametrize("head_dim", [32, 96])
def test_group_not_a_power_of_two_and_other_head_dims(head_dim):
    """SmolLM2's 3 query heads per KV head (padded rows in the tile); head dims padded to a power of two."""
    check(make_batch([0, 30], [9, 1], 6, 2, head_dim, torch.float32), torch.float32)


def test_block_size_32():
    check(make_batch(*MIXED, 4, 2, 64, torch.float32, block_size=32), torch.float32)


@pytest.mark.parametrize("window, softcap", [(None, None), (None, 2.0), (8, 2.0)])
def test_reference_equals_the_model_attention_path(window, softcap):
    """The reference computes what layers/attention.py computes for the same mixed batch (fp32), soft-capped
    (Gemma 2: the model path writes the product out, SDPA cannot cap) and windowed too."""
    args = make_batch(*MIXED, 4, 2, 64, torch.float32)
    args["scale"] *= 4  # scores well past the cap, so capping changes them
    seq_lens = args["seq_lens"].tolist()
    tables = [row[:-(-n // 16)] for row, n in zip(args["block_tables"].tolist(), seq_lens)]
    meta = layers_attention.AttentionMetadata.build(MIXED[1], seq_lens, tables, 16, DEVICE).for_window(window)
    kv_cache = torch.stack([args["key_cache"], args["value_cache"]])
    flat = kv_cache.view(2, -1, 2, 64)
    key, value = flat[0, meta.slot_mapping], flat[1, meta.slot_mapping]  # the new tokens' K/V, already stored
    expected = layers_attention.paged_attention(args["query"], key, value, kv_cache, meta, args["scale"], softcap)
    reference = paged_attention_reference(**args, sliding_window=window, softcap=softcap)
    torch.testing.assert_close(reference.flatten(1), expected, atol=2e-5, rtol=2e-5)
    if softcap is not None:  # the cap mattered
        assert (reference - paged_attention_reference(**args, sliding_window=window)).abs().max() > 0.1


@pytest.mark.parametrize("splits", [None, 1, 3])
@pytest.mark.parametrize("window", [None, 8])
def test_softcap_matches_reference(splits, window):
    args = make_batch(*MIXED, 4, 2, 64, torch.float32)
    args["scale"] *= 4
    check(args, torch.float32, sliding_window=window, softcap=2.0, num_kv_splits=splits)


# tiles every query row sees whole (no masks) before the causal edge: a prompt longer than a key tile, chunks whose
# causal edge crosses a tile boundary, ends one or two keys before one, or follows a long cached prefix, decodes over
# several tiles
LONG = ([0, 60, 62, 63, 150, 200], [140, 40, 40, 40, 40, 1])


@pytest.mark.parametrize("tiles", [paged_attention_module.PREFILL_TILES, (128, 32, 8, 2), (32, 128, 4, 3)])
@pytest.mark.parametrize("extra", [{}, {"softcap": 2.0}, {"sliding_window": 70}])
def test_unmasked_key_tiles_and_prefill_tile_sizes(monkeypatch, tiles, extra):
    monkeypatch.setattr(paged_attention_module, "PREFILL_TILES", paged_attention_module.PrefillTiles(*tiles))
    check(make_batch(*LONG, 4, 2, 32, torch.float32), torch.float32, **extra)


@pytest.mark.parametrize("decodes", [21, 140])
@pytest.mark.parametrize("order", ["decodes first", "prompts first"])
def test_many_sequences_pack_their_query_tiles(order, decodes):
    """Query tiles packed over the sequences: each program finds its sequence among many (decodes, prompts of several
    tiles, an empty padding sequence; up to 143 sequences), whatever their order."""
    context, queries = [30 + i % 40 for i in range(decodes)] + [0, 60, 9], [1] * decodes + [100, 37, 0]
    if order == "prompts first":
        context, queries = context[::-1], queries[::-1]
    check(make_batch(context, queries, 4, 2, 32, torch.float32), torch.float32)


def test_unmasked_key_tiles_with_a_position_bias():
    args = make_batch(*LONG, 4, 2, 32, torch.float32)
    bias = torch.randn(100, 4, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    check(args, torch.float32, position_bias=bias)


def test_mismatched_heads_are_refused():
    args = make_batch([0], [3], 3, 2, 64, torch.float32)
    with pytest.raises(ValueError, match="multiple of the cache's KV heads"):
        paged_attention(**args)


@gpu_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [(32, 8, 128), (9, 3, 64)])  # Llama-3-8B, SmolLM2
def test_model_shapes_mixed_and_decode(dtype, heads):
    check(make_batch([0, 300, 1000, 4095], [512, 200, 1, 1], *heads, dtype), dtype)
    check(make_batch([4095, 2000, 17, 0] * 8, [1] * 32, *heads, dtype), dtype)
    check(make_batch([4095], [1], *heads, dtype, block_size=32), dtype)
    check(make_batch([3000, 100], [1, 1], *heads, dtype), dtype, sliding_window=1024)


@pytest.mark.parametrize("splits", [None, 1, 3])
def test_cross_attention_sees_every_encoder_key(splits):
    """causal=False (an encoder-decoder's cross-attention): each sequence's new tokens, however many, attend to all
    its seq_lens keys, including a query longer than the keys; equal to the model's torch path (build_cross)."""
    encoder_lens, query_lens = [37, 5, 150, 16], [1, 9, 40, 3]  # 150 keys: two whole key tiles, unmasked
    args = make_batch(encoder_lens, [1] * 4, 4, 4, 64, torch.float32)  # blocks for the encoder's keys
    if splits is not None:  # a decode batch: one query each
        query_lens = [1] * 4
    starts = torch.tensor([0] + query_lens).cumsum(0).to(torch.int32)
    generator = torch.Generator().manual_seed(1)
    args.update(query=torch.randn(sum(query_lens), 4, 64, generator=generator).to(DEVICE),
                seq_lens=torch.tensor(encoder_lens, dtype=torch.int32, device=DEVICE),
                query_start_loc=starts.to(DEVICE), max_query_len=max(query_lens))
    got = paged_attention(**args, causal=False, num_kv_splits=splits)
    torch.testing.assert_close(got, paged_attention_reference(**args, causal=False), atol=1e-4, rtol=1e-4)
    tables = [row[:-(-n // 16)] for row, n in zip(args["block_tables"].tolist(), encoder_lens)]
    self_tables = [list(range(-(-q // 16))) for q in query_lens]
    meta = layers_attention.AttentionMetadata.build(query_lens, query_lens, self_tables, 16, DEVICE)
    meta.cross = layers_attention.AttentionMetadata.build_cross(query_lens, encoder_lens, tables, 16, DEVICE)
    kv_cache = torch.stack([args["key_cache"], args["value_cache"]])
    expected = layers_attention.paged_attention(args["query"], None, None, kv_cache, meta.cross, args["scale"])
    torch.testing.assert_close(got.flatten(1), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("splits", [None, 3])
def test_position_bias_table_matches_reference_and_the_model_path(splits):
    """T5's causal relative-position bias: a [rows, Hq] table of the bias of a key d positions back (longer
    distances use the last row), added to the scores; the kernel, its reference and the torch path agree."""
    query_lens = [1, 1, 1] if splits else MIXED[1]
    context_lens = [0, 150, 33] if splits else MIXED[0]
    args = make_batch(context_lens, query_lens, 4, 4, 64, torch.float32, block_size=32 if splits else 16)
    table = torch.randn(9, 4, generator=torch.Generator().manual_seed(3)).to(DEVICE)  # distances 0..7, then 8+
    got = paged_attention(**args, position_bias=table, num_kv_splits=splits)
    torch.testing.assert_close(got, paged_attention_reference(**args, position_bias=table), atol=1e-4, rtol=1e-4)
    block_size = args["key_cache"].shape[1]
    seq_lens = args["seq_lens"].tolist()
    tables = [row[:-(-n // block_size)] for row, n in zip(args["block_tables"].tolist(), seq_lens)]
    meta = layers_attention.AttentionMetadata.build(query_lens, seq_lens, tables, block_size, DEVICE)
    meta.add_position_bias(lambda q, k: table[(q[:, None] - k[None, :]).clamp(0, 8)].permute(2, 0, 1))
    kv_cache = torch.stack([args["key_cache"], args["value_cache"]])
    flat = kv_cache.view(2, -1, 4, 64)
    key, value = flat[0, meta.slot_mapping], flat[1, meta.slot_mapping]
    expected = layers_attention.paged_attention(args["query"], key, value, kv_cache, meta, args["scale"])
    torch.testing.assert_close(got.flatten(1), expected, atol=1e-4, rtol=1e-4)
