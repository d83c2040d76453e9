"""Paged attention on the GPU (Llama-3-8B's heads: 32 query, 8 KV, dim 128, bf16): the KV bytes a decode batch reads
per second against the GPU's copy bandwidth, the time of a step of decodes beside a prompt chunk, and prompts alone
(causal TFLOP/s) against torch's scaled_dot_product_attention on the same prompts as dense tensors.

    python3 benchmarks/attention_gpu.py [--kv-cache-dtype fp8] [--prefill-tiles ROWS,KEYS,WARPS,STAGES ...]

Several --prefill-tiles time the launches with prompt rows once per tile choice (kernels/paged_attention.py's
PREFILL_TILES), each checked against the first choice's output.

Each figure is GPU time per call replayed from a CUDA graph with L2 flushed between calls (quant_kernels_gpu.time_it),
as the engine's decode steps run: timed eagerly, a launch of a few tens of microseconds measures Python's launch
(about 85 us for one sequence of 2,048 to 8,192 keys, whatever its length).
"""
from __future__ import annotations

import argparse

import torch

from quant_kernels_gpu import time_it

from fasterllm.bench.gpu_roofline import copy_bandwidth
from fasterllm.kernels import paged_attention as paged_attention_module
from fasterllm.kernels.paged_attention import PrefillTiles, paged_attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16


def median_ms(fn) -> float:
    return 1e3 * time_it(fn)


def batch(context_lens: list[int], query_lens: list[int], cache_dtype: torch.dtype = torch.bfloat16,
          table_keys: int = 0):
    """A cache holding every sequence in blocks of its own (shuffled) and the kernel's arguments; returns them with
    the KV bytes the sequences hold. table_keys: block tables at least this many keys wide, as the engine's decode
    graphs stage them (max_model_len wide), which sets the split count."""
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    blocks = [-(-n // BLOCK) for n in seq_lens]
    order = torch.randperm(sum(blocks), device="cuda").to(torch.int32)
    tables = torch.zeros(len(seq_lens), max(blocks + [table_keys // BLOCK]), dtype=torch.int32, device="cuda")
    start = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = order[start:start + n]
        start += n
    cache = torch.randn(2, sum(blocks), BLOCK, KV_HEADS, HEAD_DIM, device="cuda").to(cache_dtype)
    query = torch.randn(sum(query_lens), HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    starts = torch.tensor([0] + query_lens, device="cuda").cumsum(0).to(torch.int32)
    args = dict(query=query, key_cache=cache[0], value_cache=cache[1], block_tables=tables,
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"), query_start_loc=starts,
                max_query_len=max(query_lens), scale=HEAD_DIM ** -0.5)
    return args, sum(seq_lens) * KV_HEADS * HEAD_DIM * 2 * cache.element_size()  # K and V


def causal_flops(context_lens: list[int], query_lens: list[int]) -> float:
    """The products of causal attention (QK^T and PV over the keys each query sees) of queries after cached keys."""
    return sum(4 * HEADS * HEAD_DIM * (q * c + q * (q + 1) / 2) for c, q in zip(context_lens, query_lens))


def sdpa_ms(prompt_lens: list[int]) -> float:
    """torch's causal attention (its fused Flash / cuDNN kernels) on the same prompts, one [1, H, n, D] call each."""
    calls = [(torch.randn(1, HEADS, n, HEAD_DIM, dtype=torch.bfloat16, device="cuda"),
              torch.randn(1, KV_HEADS, n, HEAD_DIM, dtype=torch.bfloat16, device="cuda"),
              torch.randn(1, KV_HEADS, n, HEAD_DIM, dtype=torch.bfloat16, device="cuda")) for n in prompt_lens]
    return median_ms(lambda: [torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                               enable_gqa=True) for q, k, v in calls])


def prompt_rows(tiles: list[PrefillTiles], cache_dtype: torch.dtype) -> None:
    """Launches with prompt rows, timed under each tile choice, and prompts alone against torch's attention."""
    mixed = [(f"mixed 255 decodes x 900 keys + a {chunk}-token prompt", [900] * 255 + [0], [1] * 255 + [chunk])
             for chunk in (2048, 512)] + [("mixed 64 decodes x 640 keys + a 200-token prompt", [640] * 64 + [0],
                                           [1] * 64 + [200])]
    prompts = [(f"{count} prompts of {n} tokens", [0] * count, [n] * count) for count, n in ((4, 2048), (8, 1024),
                                                                                          (16, 512))]
    prompts.append(("a 1,024-token chunk after 3,072 cached", [3072], [1024]))
    for name, context, queries in mixed + prompts:
        args, _ = batch(context, queries, cache_dtype)
        first = None
        for choice in tiles:
            paged_attention_module.PREFILL_TILES = choice
            out = paged_attention(**args)
            first = out if first is None else first
            torch.testing.assert_close(out, first, atol=2e-2, rtol=2e-2)
            ms = median_ms(lambda: paged_attention(**args))
            flops = "" if name.startswith("mixed") else f", {causal_flops(context, queries) / ms / 1e9:,.0f} TFLOP/s"
            print(f"{name}, tiles {tuple(choice)}: {ms * 1e3:.1f} us{flops}")
        if not any(context):
            ms = sdpa_ms(queries)
            print(f"{name}, torch sdpa: {ms * 1e3:.1f} us, {causal_flops(context, queries) / ms / 1e9:,.0f} TFLOP/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto", help="auto: bf16")
    parser.add_argument("--prefill-tiles", action="append", default=[],
                        type=lambda text: PrefillTiles(*map(int, text.split(","))),
                        help="ROWS,KEYS,WARPS,STAGES for launches with prompt rows (repeatable; default: the module's)")
    parsed = parser.parse_args()
    cache_dtype = torch.float8_e4m3fn if parsed.kv_cache_dtype == "fp8" else torch.bfloat16
    copy_gbs = copy_bandwidth(torch.device("cuda"), gib=1.0) / 1e9  # read + write
    print(f"{torch.cuda.get_device_name()}: device copy {copy_gbs:,.0f} GB/s (read + write); cache {cache_dtype}")
    # the last three: batch 1 as a decode graph of an 8,192-token model runs it (32 splits, mostly empty)
    for num_seqs, context, table_keys in ((256, 900, 0), (64, 640, 0), (16, 2048, 0), (1, 8192, 0), (1, 32000, 0),
                                          (1, 384, 8192), (4, 384, 8192), (1, 2048, 8192)):
        args, kv_bytes = batch([context] * num_seqs, [1] * num_seqs, cache_dtype, table_keys)
        ms = median_ms(lambda: paged_attention(**args))
        wide = f" (table {table_keys} keys wide)" if table_keys else ""
        print(f"decode {num_seqs} x {context} keys{wide}: {ms * 1e3:.1f} us, KV read {kv_bytes / ms / 1e6:,.0f} GB/s "
              f"({kv_bytes / ms / 1e6 / copy_gbs:.0%} of copy)")
    prompt_rows(parsed.prefill_tiles or [paged_attention_module.PREFILL_TILES], cache_dtype)


if __name__ == "__main__":
    main()
