"""Tile sweep of the fused MoE kernel (kernels/fused_moe.py) on a GPU, at Qwen3-30B-A3B's expert shape (128 experts
of 768 x 2048, top 8) or Mixtral-8x7B's (8 of 14,336 x 4,096, top 2), for decode-sized and prefill-sized token
counts: the default path's time (for at most ROW_SLOTS slots the matrix-vector launches) beside the tiled launches'
time per config, the weight bytes they read over that time, and the layer's routing and grouping by expert around
them (fused_experts' time includes its grouping). Each is timed as CUDA-graph replays, as the engine's decode steps
run, with L2 flushed between calls (quant_kernels_gpu.time_it; the figures in RESULTS.md up to commit c53dd54
replayed without the flush).

    python3 benchmarks/moe_kernel_gpu.py [--shape mixtral-8x7b] [--tokens 1 16 64 256 2048 8192]
"""
from __future__ import annotations

import argparse
import itertools

import torch

from fasterllm.bench.gpu_roofline import copy_bandwidth
from fasterllm.kernels.fused_moe import ROW_SLOTS, TileConfig, fused_experts, tile_config
from fasterllm.kernels.moe_align import align_by_expert
from fasterllm.kernels.quant_split_k import shared_memory_limit
from fasterllm.layers.moe import route
from quant_kernels_gpu import time_it  # CUDA-graph replays, L2 flushed between calls

SHAPES = {"qwen3-30b-a3b": (128, 2048, 768, 8), "mixtral-8x7b": (8, 4096, 14336, 2)}  # experts, hidden, inter, top k


def candidates(num_tokens: int, experts: int, top_k: int, shared_memory: int) -> list[TileConfig]:
    """The sweep's tiles, less those whose gate/up launch needs more shared memory than the device has (bf16 x, gate
    and up tiles per pipeline stage): fused_experts would fall back to SMALL_TILES, and inside a graph capture that
    failed launch ends the capture."""
    if num_tokens * top_k // experts < 16:  # under a tile's worth of slots per expert: weight-read bound
        grid = itertools.product([16], [32, 64, 128], [64, 128, 256], [4], [2, 3, 4])
    else:
        grid = itertools.product([16, 32, 64, 128], [64, 128], [64, 128], [4, 8], [3, 4])
    configs = [TileConfig(*c) for c in grid]
    return [c for c in configs if c.num_stages * (c.block_m + 2 * c.block_n) * c.block_k * 2 <= shared_memory]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 256, 2048, 8192])
    args = parser.parse_args()
    num_experts, hidden, inter, top_k = SHAPES[args.shape]
    device = torch.device("cuda")
    bandwidth = copy_bandwidth(device)
    generator = torch.Generator(device=device).manual_seed(0)
    router = torch.randn(num_experts, hidden, device=device, generator=generator).to(torch.bfloat16)
    w_gate_up = torch.randn(num_experts, 2 * inter, hidden, device=device, generator=generator).div(hidden**0.5)
    w_gate_up = w_gate_up.bfloat16()
    w_down = (torch.randn(num_experts, hidden, inter, device=device, generator=generator) / inter**0.5).bfloat16()
    print(f"{torch.cuda.get_device_name()}; copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    for num_tokens in args.tokens:
        x = torch.randn(num_tokens, hidden, device=device, generator=generator).bfloat16()
        weights, experts = route(x, router, top_k, normalize=True)
        used = experts.unique().numel()
        weight_bytes = used * (w_gate_up[0].numel() + w_down[0].numel()) * 2
        reference = fused_experts(x, w_gate_up, w_down, weights, experts, "silu", TileConfig(16, 64, 32, 4, 2))
        routing = time_it(lambda: route(x, router, top_k, normalize=True))
        default = tile_config(num_tokens * top_k, num_experts)
        grouping = time_it(lambda: align_by_expert(experts, num_experts, default.block_m))
        results = []
        for config in candidates(num_tokens, num_experts, top_k, shared_memory_limit(device)):
            try:
                out = fused_experts(x, w_gate_up, w_down, weights, experts, "silu", config)
            except Exception as exc:  # a config the device cannot hold (shared memory)
                print(f"  {config}: {type(exc).__name__}")
                continue
            error = (out.float() - reference.float()).abs().max().item()
            seconds = time_it(lambda: fused_experts(x, w_gate_up, w_down, weights, experts, "silu", config))
            results.append((seconds, config, error))
        results.sort(key=lambda r: r[0])
        now = time_it(lambda: fused_experts(x, w_gate_up, w_down, weights, experts, "silu"))
        path = "matrix-vector launches" if num_tokens * top_k <= ROW_SLOTS else default
        print(f"tokens {num_tokens}: {used} experts used, {weight_bytes / 1e6:.1f} MB of their weights; route "
              f"{routing * 1e6:.1f} us, grouping by expert {grouping * 1e6:.1f} us; default ({path}): "
              f"{now * 1e6:.1f} us ({weight_bytes / now / 1e12:.2f} TB/s); swept tiles, fastest first:")
        for seconds, config, error in results[:5]:
            print(f"  {seconds * 1e6:8.1f} us  {weight_bytes / seconds / 1e12:5.2f} TB/s  "
                  f"{2 * num_tokens * top_k * 3 * hidden * inter / seconds / 1e12:6.1f} TFLOP/s  "
                  f"max diff {error:.3g}  {config}")


if __name__ == "__main__":
    main()
