"""Paged attention on the GPU (Llama-3-8B's heads: 32 query, 8 KV, dim 128, bf16): the KV bytes a decode batch reads
per second against the GPU's copy bandwidth, and the time of a step of decodes beside a prompt chunk.

    python3 benchmarks/attention_gpu.py [--kv-cache-dtype fp8]

Each figure is GPU time per call replayed from a CUDA graph with L2 flushed between calls (quant_kernels_gpu.time_it),
as the engine's decode steps run: timed eagerly, a launch of a few tens of microseconds measures Python's launch
(about 85 us for one sequence of 2,048 to 8,192 keys, whatever its length).
"""
from __future__ import annotations

import argparse

import torch

from quant_kernels_gpu import time_it

from fasterllm.bench.gpu_roofline import copy_bandwidth
from fasterllm.kernels.paged_attention import paged_attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16


def median_ms(fn) -> float:
    return 1e3 * time_it(fn)


def batch(context_lens: list[int], query_lens: list[int], cache_dtype: torch.dtype = torch.bfloat16):
    """A cache holding every sequence in blocks of its own (shuffled) and the kernel's arguments; returns them with
    the KV bytes the sequences hold."""
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    blocks = [-(-n // BLOCK) for n in seq_lens]
    order = torch.randperm(sum(blocks), device="cuda").to(torch.int32)
    tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32, device="cuda")
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto", help="auto: bf16")
    cache_dtype = torch.float8_e4m3fn if parser.parse_args().kv_cache_dtype == "fp8" else torch.bfloat16
    copy_gbs = copy_bandwidth(torch.device("cuda"), gib=1.0) / 1e9  # read + write
    print(f"{torch.cuda.get_device_name()}: device copy {copy_gbs:,.0f} GB/s (read + write); cache {cache_dtype}")
    for num_seqs, context in ((256, 900), (64, 640), (16, 2048), (1, 8192), (1, 32000)):
        args, kv_bytes = batch([context] * num_seqs, [1] * num_seqs, cache_dtype)
        ms = median_ms(lambda: paged_attention(**args))
        print(f"decode {num_seqs} x {context} keys: {ms * 1e3:.1f} us, KV read {kv_bytes / ms / 1e6:,.0f} GB/s "
              f"({kv_bytes / ms / 1e6 / copy_gbs:.0%} of copy)")
    for decodes, context, chunk in ((255, 900, 2048), (64, 640, 200), (255, 900, 512)):
        args, kv_bytes = batch([context] * decodes + [0], [1] * decodes + [chunk], cache_dtype)
        ms = median_ms(lambda: paged_attention(**args))
        print(f"mixed {decodes} decodes x {context} keys + a {chunk}-token prompt: {ms * 1e3:.1f} us")


if __name__ == "__main__":
    main()
